"""A conversation's end is recorded with its last row, and ``producer wait``, ``status`` and ``verify`` agree.

Every conversation of a ``--turns all`` job (and every agentic turn's chain of steps) ends in exactly one recorded
way: ``complete`` (its last turn answered), or ended with a reason (``tool_mismatch``, ``max_tool_steps``,
``tool_error``, ``tool_call``, ``error: …``) — stored in the ``chain_end`` column of the chain's last row in Parquet
(thinkfleet/chain_end.py), so it survives a purge or the loss of Redis. A row whose chain goes on says ``""`` there;
its successor (the next step, or the next turn) must then be stored, pending or dead-lettered — a conversation whose
last stored row goes on to nothing *stopped without a reason*: verify fails on it (MISSING TURNS) and wait does not
call the job finished (exit 3) — one rule, :func:`thinkfleet.chain_end.owed_successors`.

End to end (real workers, the simulator with the dataset's tools in its catalogue, real Parquet, the CLI):

- an agentic replay job whose recorded turn 0 calls one tool: the model's calls decode; many chains end at a tool
  call the dataset has no result for (parallel calls, or a call at a step the dataset answers) — some at a step
  after results were fed back, before the last turn. ``wait`` finishes and ``verify`` passes (it flagged those
  conversations' next turn as MISSING before), and every ended chain's last row carries its reason;
- an agentic executor job whose chains end at ``max_tool_steps`` before their last turn: the same;
- a ``--turns all`` job one of whose next turns is lost after its predecessor was stored (as a purge and re-submit
  of issue 32 lost them): ``wait`` exits 3 naming the conversation and ``verify`` fails with the same turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from producer.render import load_tokenizer
from sglang_sim.tools import write_catalogue
from storage.reader import read_committed
from testing.datasets import write_jsonl
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.turns import split_step_id
from workers.tool_exec import TRUSTED_ENV

if TYPE_CHECKING:
    from testing.services import RedisServer

ROOT = Path(__file__).parents[1]
EXECUTOR = f"{ROOT / 'docs/examples/agentic/tools.py'}:execute"
CONVERSATIONS = 40
EXEC_CONVERSATIONS = 24
SIM_CONTENT = {"tool_call_share": 0.6, "length_median_tokens": 40.0, "max_tool_calls": 2}
REPLAY, EXEC = "ends-replay", "ends-exec"


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _rows(n: int) -> list[dict[str, Any]]:
    """Two user turns; the recorded turn 0 calls the calculator once (one result) before its answer."""
    rows = []
    for c in range(n):
        msgs = [
            {"role": "system", "content": "You are a careful assistant with tools."},
            {"role": "user", "content": f"How long is trip {c}?"},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, "calculator", {"expression": "240 / 80"})]},
            {"role": "tool", "tool_call_id": "functions.calculator:0", "content": f"recorded 3 ({c})"},
            {"role": "assistant", "content": "Three hours."},
            {"role": "user", "content": f"And back, for chat {c}?"},
            {"role": "assistant", "content": "Three again."},
        ]
        rows.append({"id": f"c{c}", "messages": msgs})
    return rows


@dataclass
class Fleet:
    settings: Settings
    client: redis.Redis
    tmp: Path
    tok_dir: Path


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Both agentic jobs submitted through the CLI and run to their end by two real workers on the simulator."""
    tmp = tmp_path_factory.mktemp("chain-ends")
    (tmp / "logs").mkdir()
    settings = isolated_settings(redis_server.url(0), str(tmp / "out"))
    client = redis.Redis.from_url(settings.redis_url)
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp / "tools.json", load_tokenizer(str(tok_dir)), "kimi")
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "400"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    common = [
        "--tokenizer", str(tok_dir), "--processes", "1", "--no-progress", "--max-new-tokens", "400", "--seed", "5",
        "--context-length", "131072", "--turns", "all", "--json",
    ]  # fmt: skip
    replay = write_jsonl(tmp / "replay" / "chat.jsonl", _rows(CONVERSATIONS))
    executor = write_jsonl(tmp / "exec" / "chat.jsonl", _rows(EXEC_CONVERSATIONS))
    with simulator(tmp / "logs", *sim_args) as sim:
        env = {**fast_env(settings, sim, max_inflight=8), TRUSTED_ENV: EXECUTOR}
        workers = [WorkerProcess(f"w{i}", env, tmp / "logs").start() for i in range(2)]
        try:
            submits = (
                (REPLAY, replay, ["--tool-results", "replay", "--max-tool-steps", "3"]),
                (EXEC, executor, ["--tool-results", "executor", "--tool-executor", EXECUTOR, "--max-tool-steps", "2"]),
            )
            for job, data, extra in submits:
                done = producer_cli(settings, "submit", str(data), "--job", job, *common, *extra)
                assert done.returncode == 0, done.stderr
            for w in workers:
                w.wait_ready(client, settings.keys)

            def settled() -> bool:
                for job in (REPLAY, EXEC):
                    p = job_progress(client, settings.keys, job)
                    if not (p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]):
                        return False
                return True

            wait_until(settled, 240, what="both agentic jobs")
            yield Fleet(settings, client, tmp, tok_dir)
        finally:
            for w in workers:
                w.terminate()
    client.close()


def _answers(run: Fleet, job: str) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.turn_answers(job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _wait_and_verify(run: Fleet, job: str) -> tuple[Any, Any]:
    waited = producer_cli(run.settings, "wait", job, "--timeout", "60", "--json")
    verified = producer_cli(run.settings, "verify", job, "--json")
    return waited, verified


def _last_rows(run: Fleet, job: str) -> dict[str, dict[str, Any]]:
    """Per conversation, its stored row furthest along the chain (by turn, then step)."""
    rows = read_committed(run.settings.output_uri, job).to_pylist()
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        conv, turn, step = split_step_id(row["prompt_id"]) or ("", 0, 0)
        held = last.get(conv)
        if held is None or (turn, step) > split_step_id(held["prompt_id"])[1:]:  # type: ignore[index]
            last[conv] = row
    return last


def _assert_agree_and_recorded(run: Fleet, job: str, reason: str) -> None:
    waited, verified = _wait_and_verify(run, job)
    report = json.loads(verified.stdout)
    assert (waited.returncode == 0) == (verified.returncode == 0), (waited.stderr, verified.stdout)
    assert waited.returncode == 0, waited.stderr
    assert verified.returncode == 0 and report["missing_turns"] == [], verified.stdout
    answers = _answers(run, job)
    last = _last_rows(run, job)
    assert len(last) == len({json.loads(line)["id"] for line in (run.tmp / job.split("-")[1] / "chat.jsonl").open()})
    early = 0
    for conv, row in last.items():
        record = answers[row["prompt_id"]]
        want = record.get("chain_end") or "complete"
        assert row["chain_end"] == want, (conv, row["prompt_id"], row["chain_end"], record)
        _, turn, step = split_step_id(row["prompt_id"]) or ("", 0, 0)
        early += want == reason and turn + 1 < row["turn_count"] and step > 0
    # The case verify used to flag: a chain ended at a step after results were fed back, before the last turn.
    assert early >= 1, f"no chain of {job} ended with {reason} at a step > 0 before its last turn"


def test_replay_chains_ending_at_a_call_the_dataset_cannot_answer_finish_and_verify(fleet: Fleet) -> None:
    _assert_agree_and_recorded(fleet, REPLAY, "tool_mismatch")


def test_executor_chains_ending_at_max_tool_steps_finish_and_verify(fleet: Fleet) -> None:
    _assert_agree_and_recorded(fleet, EXEC, "max_tool_steps")
