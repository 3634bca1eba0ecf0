"""`producer submit` from the command line: flags reach the submit, errors exit non-zero with the fix."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
import redis
from click.testing import CliRunner

from producer.cli import cli
from producer.job import JobRecord
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask


@pytest.fixture(scope="module")
def tok_dir() -> str:
    return str(build_test_tokenizer(default_test_tokenizer_dir()))


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_dry_run_json_reports_and_enqueues_nothing(redis_url, redis_client, tok_dir, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(8, words=20))
    code, out, err = run(
        "submit", str(path), "--job", "d", "--tokenizer", tok_dir, "--dry-run", "--json",
        "--hosts", "8", "--server-tok-s", "860", "--processes", "1", "--redis-url", redis_url,
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["dry_run"] is True and report["enqueued"] == 8
    assert set(report["prompt_length"]) == {"count", "min", "median", "mean", "p99", "max"}
    assert report["projected_wall_s"] == pytest.approx(8 * 1416 / (8 * 860), abs=0.1)
    assert report["estimated_redis_bytes"] > 0
    assert redis_client.dbsize() == 0


def test_flags_reach_the_job_record_and_thinking_off_closes_the_think_block(
    redis_url, redis_client: redis.Redis, tok_dir, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(3, words=10))
    code, out, err = run(
        "submit", str(path), "--job", "f", "--tokenizer", tok_dir, "--redis-url", redis_url, "--queue", "q2",
        "--output-uri", str(tmp_path / "out"), "--chat-template-kwargs", '{"thinking": false}',
        "--max-new-tokens", "2048", "--temperature", "0.6", "--top-k", "20", "--stop-token-ids", "163586,163585",
        "--dataset-name", "renamed", "--expect-model", "/shared/kimi-k2.5-int4", "--json", "--processes", "1",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["enqueued"] == 3
    record = JobRecord.load(redis_client, Keys(), "f")
    assert record.chat_template_kwargs == {"thinking": False}
    assert record.sampling_params["max_new_tokens"] == 2048 and record.sampling_params["top_k"] == 20
    assert record.stop_token_ids == [kimi.IM_END, kimi.EOS]
    assert record.datasets == {"renamed": 3} and record.expected_model == "/shared/kimi-k2.5-int4"
    raw = json.loads(redis_client.lindex("q2", -1))
    task = PromptTask.from_args(msgpack.unpackb(base64.b64decode(raw["body"]), raw=False)[0])
    assert task.input_ids[-2:] == [kimi.THINK_START, kimi.THINK_END]
    assert task.prompt_id == "renamed/r0"


def test_bad_input_exits_non_zero_naming_file_and_fix(redis_url, redis_client, tok_dir, tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(3, words=10))
    bad = write_jsonl(tmp_path / "beta.jsonl", [{"text": "no conversation column"}])
    code, _, err = run("submit", str(good), str(bad), "--job", "b", "--tokenizer", tok_dir,
                         "--redis-url", redis_url, "--processes", "1")  # fmt: skip
    assert code == 1
    assert "beta.jsonl:1: no conversation column" in err and "--messages-column" in err
    assert redis_client.dbsize() == 0  # the good file's prompts were staged and dropped
    code, _, err = run("submit", str(good), "--job", "b", "--tokenizer", str(tmp_path / "nope"),
                         "--redis-url", redis_url)  # fmt: skip
    assert code == 1 and "cannot load tokenizer" in err
    code, _, err = run("submit", str(good), "--job", "b", "--tokenizer", tok_dir, "--chat-template-kwargs", "{")
    assert code == 2 and "--chat-template-kwargs" in err


@pytest.mark.parametrize("args", [["status", "j"], ["jobs"], ["pause", "j"], ["resume", "j"], ["retry", "j"]])
def test_a_one_shot_command_against_a_redis_that_does_not_answer_says_so_in_one_line(args: list[str]) -> None:
    # Given no Redis at the URL (the head down, restarting or failing over), When a one-shot command runs,
    # Then it exits non-zero with one line naming Redis and the fix, never a traceback.
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = run(*args, "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert code != 0, out + err
    said = (out + err).strip()
    assert "Traceback" not in said and "Redis" in said, said
    assert len(said.splitlines()) <= 2, said
