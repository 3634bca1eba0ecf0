"""``producer verify``: catches what is missing, duplicated or malformed, and passes a clean job."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import redis
from click.testing import CliRunner

from storage.cli import verify
from storage.manifest import write_submitted
from storage.verify import verify_job
from storage.writer import PartWriter
from testing.rows import kimi_output, make_row
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings

JOB = "job"
KEYS = Keys("tft")


def _submit(client: redis.Redis, rows: list[dict]) -> None:
    client.hset(KEYS.prompts(JOB), mapping={r["prompt_id"]: r["content_hash"] for r in rows})
    client.hset(KEYS.prompt_dataset(JOB), mapping={r["prompt_id"]: r["dataset"] for r in rows})


def _settings(tmp_path: Path, redis_url: str, **extra: object) -> Settings:
    return Settings(output_uri=str(tmp_path), redis_url=redis_url, key_prefix=KEYS.prefix, **extra)


def _clean_job(tmp_path: Path, client: redis.Redis) -> list[dict]:
    rows = [make_row(f"p-{i}", dataset="ds" if i % 2 else "other", seed=i) for i in range(12)]
    writer = PartWriter(str(tmp_path), "w1")
    for dataset in ("ds", "other"):
        mine = [r for r in rows if r["dataset"] == dataset]
        writer.write(JOB, dataset, mine[:3])
        writer.write(JOB, dataset, mine[3:])
    _submit(client, rows)
    return rows


def _run_cli(tmp_path: Path, redis_url: str, *extra: str) -> tuple[int, str]:
    args = [JOB, "--output-uri", str(tmp_path), "--redis-url", redis_url, "--key-prefix", KEYS.prefix, *extra]
    result = CliRunner().invoke(verify, args)
    return result.exit_code, result.output


def test_clean_job_passes(tmp_path: Path, redis_url: str, redis_client: redis.Redis) -> None:
    _clean_job(tmp_path, redis_client)
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.ok, report.to_dict()
    assert (report.submitted, report.committed, report.stored_rows) == (12, 12, 12)
    assert report.submitted_source == "redis"
    assert report.per_dataset["ds"] == {"submitted": 6, "committed": 6, "missing": 0, "dead": 0}
    assert report.thinking_rows == report.think_end_rows == 12
    code, output = _run_cli(tmp_path, redis_url)
    assert code == 0 and "OK" in output


def test_planted_duplicate_is_caught(tmp_path: Path, redis_url: str, redis_client: redis.Redis) -> None:
    rows = _clean_job(tmp_path, redis_client)
    PartWriter(str(tmp_path), "w2").write(JOB, "ds", [rows[3]])  # p-3 delivered and stored twice
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.duplicated == ["p-3"] and report.duplicate_rows == 1
    assert not report.missing and not report.ok
    code, output = _run_cli(tmp_path, redis_url)
    assert code == 1 and "DUPLICATED: 1" in output and "p-3" in output


def test_planted_missing_prompt_is_caught(tmp_path: Path, redis_url: str, redis_client: redis.Redis) -> None:
    _clean_job(tmp_path, redis_client)
    extra = [make_row("p-99", dataset="ds"), make_row("p-98", dataset="ds")]
    _submit(redis_client, extra)  # submitted, never stored
    redis_client.hset(KEYS.dead(JOB), "p-98", json.dumps({"error_class": "BadRequest", "attempts": 1}))
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.missing == ["p-99"]
    assert report.permanent_failures == ["p-98"]  # dead-lettered: reported, not missing
    assert report.per_dataset["ds"]["missing"] == 1 and report.per_dataset["ds"]["dead"] == 1
    code, output = _run_cli(tmp_path, redis_url, "--json")
    assert code == 1
    payload = json.loads(output)
    assert payload["missing"] == ["p-99"] and payload["ok"] is False


def test_malformed_rows_are_caught(tmp_path: Path, redis_url: str, redis_client: redis.Redis) -> None:
    rows = _clean_job(tmp_path, redis_client)
    bad = make_row("p-50", dataset="ds", completion_tokens=3)  # wrong count
    swapped = make_row("p-51", dataset="ds")
    swapped.update(reasoning_start=5, reasoning_end=2, has_think_end=True, answer_start=6, answer_end=8,
                   tool_call_spans=[], stop_token=None)  # fmt: skip
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", [bad])
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", [swapped])
    _submit(redis_client, [*rows, bad, swapped])
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert set(report.malformed) == {"p-50", "p-51"}
    assert report.malformed["p-50"] == ["completion_tokens != len(output_ids)"]
    problems = " ".join(report.malformed["p-51"])
    assert "reasoning_end < reasoning_start" in problems and "stop_token is null" in problems
    assert not report.ok


def test_manifest_stands_in_when_redis_lost_the_job(tmp_path: Path, redis_url: str) -> None:
    rows = [make_row(f"p-{i}", seed=i) for i in range(5)]
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", rows[:4])
    write_submitted(str(tmp_path), JOB, [{**r, "row_index": 0} for r in rows])
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.submitted_source == "manifest"
    assert report.missing == ["p-4"]


def test_no_submitted_set_fails(tmp_path: Path, redis_url: str) -> None:
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", [make_row("p-1")])
    report = verify_job(_settings(tmp_path, "redis://127.0.0.1:1/0"), JOB)  # Redis unreachable too
    assert report.submitted_source == "none" and not report.ok
    assert any("unreachable" in n for n in report.notes)


def test_stale_content_is_caught(tmp_path: Path, redis_url: str, redis_client: redis.Redis) -> None:
    rows = _clean_job(tmp_path, redis_client)
    redis_client.hset(KEYS.prompts(JOB), rows[0]["prompt_id"], "re-submitted-with-new-content")
    report = verify_job(_settings(tmp_path, redis_url), JOB)
    assert report.stale == [rows[0]["prompt_id"]] and not report.ok


def test_reasoning_alarm_fires_when_no_output_closes_reasoning(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The seed's bug, as data: thinking prompts, and not one </think> in the outputs.
    rng = np.random.default_rng(3)
    rows = [make_row(f"p-{i}", output_ids=kimi_output(rng, 40, 0, think_end=False)) for i in range(10)]
    PartWriter(str(tmp_path), "w1").write(JOB, "ds", rows)
    _submit(redis_client, rows)
    report = verify_job(_settings(tmp_path, redis_url, alarm_min_rows=5), JOB)
    assert report.reasoning_alarm and report.think_end_rows == 0 and not report.ok
    assert any("no </think>" in n for n in report.notes)
    monkeypatch.setenv("THINKFLEET_ALARM_MIN_ROWS", "5")
    code, output = _run_cli(tmp_path, redis_url)
    assert code == 1 and "REASONING ALARM" in output and "no </think>" in output
