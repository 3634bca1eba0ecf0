"""``producer report``: numbers from the committed view, a PNG and an HTML page."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from storage.cli import report
from storage.report import report_job
from storage.writer import PartWriter
from testing.rows import kimi_output, make_row
from thinkfleet.settings import Settings

JOB = "job"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _job(root: Path) -> None:
    rng = np.random.default_rng(5)
    for w in range(2):
        writer = PartWriter(str(root), f"w{w}")
        rows = []
        for i in range(10):
            truncated = i == 0
            out = kimi_output(rng, 60, 40, think_end=not truncated, stop=None if truncated else 163586)
            finish = {"type": "length", "length": 100} if truncated else "stop"
            when = T0 + timedelta(minutes=i, seconds=w)
            rows.append(make_row(f"p-{w}-{i}", output_ids=out, finish_reason=finish, worker=f"w{w}", created_at=when))
        writer.write(JOB, "ds", rows)


def test_report_summarizes_the_job(tmp_path: Path) -> None:
    _job(tmp_path)
    summary, files = report_job(Settings(output_uri=str(tmp_path)), JOB, str(tmp_path / "rep"))
    assert summary["rows"] == 20
    assert summary["finish_reasons"] == {"length": 2, "stop": 18}
    assert summary["truncation_rate"] == 0.1 and summary["think_end_rate"] == 0.9
    assert summary["output_length"]["max"] == 102  # 60 reasoning + </think> + 40 answer + <|im_end|>
    assert set(summary["workers"]) == {"w0", "w1"} and summary["workers"]["w0"]["rows"] == 10
    assert summary["tokens_per_s"] > 0 and sum(p["rows"] for p in summary["timeline"]) == 20
    card, png, page = (Path(f) for f in files)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| ds | ? | 20 | 0 | 2 | 0 | 2 | 0 | 0 |" in card.read_text()  # truncated rows never closed reasoning
    assert "thinkfleet job job" in page.read_text() and "data:image/png;base64," in page.read_text()


def test_the_card_counts_gpu_hours_and_cost_from_the_servers_launch_arguments(tmp_path: Path) -> None:
    """w0 on an 8-GPU server (tp 8, its record), w1 on one with no record (1 GPU, said so): GPU-hours are each
    server's first-to-last-row time × its GPUs, the cost at the price given; --gpus-per-host overrides both."""
    from storage.card import card_facts
    from storage.report import committed_table

    _job(tmp_path)
    settings = Settings(output_uri=str(tmp_path), redis_url="redis://127.0.0.1:1/0")
    summary, _ = report_job(settings, JOB)
    summary["servers"] = [
        {"launch_args": {"tp_size": 8, "dp_size": 1}, "workers": [{"worker": "w0", "host": "h0", "sglang_url": "u"}]}
    ]
    table = committed_table(settings, JOB)
    cost = card_facts(summary, table, None, usd_per_gpu_hour=2.5)["cost"]
    assert [s["gpus"] for s in cost["servers"]] == [8, 1] and cost["gpus_assumed"] is True
    assert cost["host_hours"] == 2 * 540 / 3600  # 9 minutes from first to last row, each
    assert cost["gpu_hours"] == (8 + 1) * 540 / 3600
    assert cost["usd"] == cost["gpu_hours"] * 2.5
    assert cost["output_tokens_per_s_per_gpu"] == summary["output_tokens"] / (9 * 540)
    one, eight = cost["projection_hours"]["1"], cost["projection_hours"]["8"]
    rate = cost["output_tokens_per_s_per_server"]  # each server's tokens over its active time, averaged
    assert one["this_job"] == summary["output_tokens"] / rate / 3600
    assert abs(one["this_job"] - 8 * eight["this_job"]) < 1e-9 and eight["seed_job_measured"] == 57 / 8
    assert one["seed_job"] == 88_088 * 1_416 / rate / 3600
    forced = card_facts(summary, table, None, gpus_per_host=4)["cost"]
    assert forced["gpu_hours"] == 4 * 1080 / 3600 and forced["gpus_assumed"] is False


def test_report_cli_prints_tables_and_json(tmp_path: Path) -> None:
    _job(tmp_path)
    result = CliRunner().invoke(report, [JOB, "--output-uri", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "w0" in result.output and "truncation_rate" in result.output
    result = CliRunner().invoke(report, [JOB, "--output-uri", str(tmp_path), "--json"])
    assert json.loads(result.output)["rows"] == 20


def test_report_counts_conversations_and_turns_of_a_multi_turn_job(tmp_path: Path) -> None:
    """``--turns all``: three 3-turn conversations, one with its last turn not stored yet, a turn delivered twice."""
    rng = np.random.default_rng(9)
    writer = PartWriter(str(tmp_path), "w0")
    for c in range(3):
        stored = 3 if c < 2 else 2
        rows = [
            make_row(
                f"conv-{c}/t{t}",
                output_ids=kimi_output(rng, 20, 10),
                conversation_id=f"conv-{c}",
                turn_index=t,
                turn_count=3,
                created_at=T0 + timedelta(minutes=t),
            )
            for t in range(stored)
        ]
        writer.write(JOB, "ds", rows)
    writer.write(JOB, "ds", [rows[0]])  # a redelivery: the committed view has it once
    summary, _ = report_job(Settings(output_uri=str(tmp_path)), JOB)
    assert summary["rows"] == summary["turns"] == 8
    assert summary["conversations"] == 3 and summary["complete_conversations"] == 2
    result = CliRunner().invoke(report, [JOB, "--output-uri", str(tmp_path)])
    assert result.exit_code == 0 and "conversations" in result.output, result.output


def test_report_of_a_single_turn_job_has_no_conversation_counts(tmp_path: Path) -> None:
    _job(tmp_path)
    summary, _ = report_job(Settings(output_uri=str(tmp_path)), JOB)
    assert summary["conversations"] is None and summary["turns"] is None
