"""``tool_results: executor``: the job's executor is called at most once per step revision and calls, its results
recorded.

Given a real Redis, a real claim (thinkfleet/state/ledger.py) and executors written as files (workers/tool_exec.py
loads ``file.py:function``): a second attempt of the same step revision with the same calls (a redelivery, the
orphan recovery of a worker killed after the call) reuses the recorded results without calling again; a new
revision calls again; other calls of the same revision (a regenerated step) are called for themselves, never
answered with the first calls' results; an error or timeout is retried and then recorded, and not retried by a
later attempt; a ``pending`` mark without an outcome (a worker killed during the call) is never called again; an
untrusted executor never runs; and the shipped example executor (docs/examples/agentic/tools.py) answers the
simulator's calculator and lookup. (Fenced runs: tests/test_tool_runs.py.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from testing.harness import isolated_settings
from thinkfleet.state.ledger import Ledger
from workers.tool_exec import (
    TRUSTED_ENV,
    ToolExecError,
    ToolExecutor,
    calls_digest,
    executed_results,
    record_field,
    stable_call_id,
)

if TYPE_CHECKING:
    from testing.services import RedisServer

EXECUTOR = """
import asyncio, json, pathlib
CALLS = pathlib.Path(__file__).with_suffix(".calls")

def _count(request):
    with CALLS.open("a") as f:
        f.write(json.dumps(request) + "\\n")

def ok(request):
    _count(request)
    return [f"result of {c['name']} for {c['id']}" for c in request["calls"]]

def fails(request):
    _count(request)
    raise RuntimeError("the tool is down")

async def slow(request):
    _count(request)
    await asyncio.sleep(30)
"""


def _calls() -> list[dict[str, Any]]:
    return [
        {"id": "functions.calculator:0", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}},
        {"id": "functions.lookup:1", "function": {"name": "lookup", "arguments": '{"key": "bridge"}'}},
    ]


def _requests(path: Path) -> list[dict[str, Any]]:
    calls = path.with_suffix(".calls")
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_an_executor_runs_at_most_once_per_step_revision_and_calls(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "executor.py"
    module.write_text(EXECUTOR)
    monkeypatch.setenv(TRUSTED_ENV, "*")
    settings = isolated_settings(redis_server.url(0), str(tmp_path / "out"))
    where = {"conversation": "chat/c0", "turn": 0, "step": 0}

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_server.url(0))
        ledger = Ledger(client, settings.keys, "w1")
        try:
            ok = ToolExecutor(f"{module}:ok", retries=1)

            async def run(executor: ToolExecutor, pid: str, revision: int = 0, calls: Any = None) -> Any:
                if ledger.fence("job", pid) is None:  # the run's claim, as the worker holds it
                    assert (await ledger.claim("job", pid, revision=revision)).state in ("new", "mine")
                return await executed_results(ledger, executor, "job", pid, revision, where, calls or _calls())

            # Given a step's calls, when two attempts of the same revision ask, then one call, the same results.
            first = await run(ok, "chat/c0/t0")
            again = await run(ok, "chat/c0/t0")
            assert first == again and [m["source"] for m in first] == ["executed", "executed"]
            assert [m["tool_call_id"] for m in first] == ["functions.calculator:0", "functions.lookup:1"]
            (request,) = _requests(module)
            assert request["conversation"] == "chat/c0" and request["job"] == "job"
            digest = calls_digest(_calls())
            assert [c["id"] for c in request["calls"]] == [stable_call_id("chat/c0/t0", 0, digest, i) for i in range(2)]
            assert (
                request["calls"][0]["name"] == "calculator"
                and request["calls"][0]["arguments"] == '{"expression": "1+1"}'
            )
            # A re-run (revision 1) of the step is its own call.
            ledger.held.clear()
            await run(ok, "chat/c0/t0", revision=1)
            assert len(_requests(module)) == 2
            # Other calls of the same revision (the step regenerated, the model sampled anew): called for themselves,
            # answered with their own results (never the first calls'), once; the first calls' record stays theirs.
            other = [_calls()[1]]
            answered = await run(ok, "chat/c0/t0", revision=1, calls=other)
            assert len(_requests(module)) == 3 and _requests(module)[-1]["calls"][0]["name"] == "lookup"
            assert [m["content"] for m in answered] == [
                f"result of lookup for {stable_call_id('chat/c0/t0', 1, calls_digest(other), 0)}"
            ]
            assert await run(ok, "chat/c0/t0", revision=1, calls=other) == answered
            assert await run(ok, "chat/c0/t0", revision=1) != answered and len(_requests(module)) == 3

            # An error is retried (1 + retries calls), then recorded: a later attempt does not call again.
            fails = ToolExecutor(f"{module}:fails", retries=2)
            with pytest.raises(ToolExecError, match="the tool is down"):
                await run(fails, "chat/c0/t1")
            with pytest.raises(ToolExecError, match="the tool is down"):
                await run(fails, "chat/c0/t1")
            assert len(_requests(module)) == 3 + 3
            # A timeout is an error like any other.
            slow = ToolExecutor(f"{module}:slow", timeout_s=0.05, retries=0)
            with pytest.raises(ToolExecError, match="TimeoutError"):
                await run(slow, "chat/c0/t2")
            # A pending mark with no outcome (the worker died during the call): never called a second time.
            field = record_field("chat/c0/t3", 0, calls_digest(_calls()))
            await client.hset(settings.keys.tool_calls("job"), field, json.dumps({"pending": True, "epoch": "1"}))
            before = len(_requests(module))
            with pytest.raises(ToolExecError, match="no recorded outcome"):
                await run(ok, "chat/c0/t3")
            assert len(_requests(module)) == before
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_an_untrusted_executor_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "executor.py"
    module.write_text(EXECUTOR)
    monkeypatch.setenv(TRUSTED_ENV, "some/other.py:execute")
    with pytest.raises(ToolExecError, match=TRUSTED_ENV):
        ToolExecutor(f"{module}:ok")


def test_the_example_executor_answers_the_simulators_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_sim.tools import DEFAULT_TOOLS

    spec = f"{Path(__file__).parents[1] / 'docs/examples/agentic/tools.py'}:execute"
    monkeypatch.setenv(TRUSTED_ENV, spec)
    executor = ToolExecutor(spec)
    calls = [{"id": str(i), "name": n, "arguments": json.dumps(a)} for i, (n, a) in enumerate(DEFAULT_TOOLS)]
    results = asyncio.run(executor.run({"job": "j", "conversation": "c", "turn": 0, "step": 0, "calls": calls}))
    assert results == ["3", "rebuilt in 1887 after a flood destroyed the wooden span", "5050"]
