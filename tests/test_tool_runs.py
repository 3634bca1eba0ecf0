"""Tool side effects are tied to the run that made the calls (``tool_results: executor``; issue 32, scenario 7).

End to end: an agentic executor job on a simulator that draws a new output for every request
(``--sample-per-request``: a regenerated step calls other tools, or the same ones, or none), workers SIGKILLed four
times after an executor's results are recorded and before the step's part is written (failpoint
``after_tool_record``), restarted each time, and one worker SIGSTOPped during its executor call, before the
record, continued once its steps were taken over and stored. Then no conversation ends ``tool_error`` (no executor
failed; but where a live run drew exactly the calls the stopped one had called: their outcome is unknown), every
step's recorded results answer the calls of the step as stored, some step was regenerated with other calls and
ran its tools again, no executor call id (one per step revision and calls) was called twice, and the paused
worker, fenced, recorded nothing.

With a real Redis and real claims (thinkfleet/state/ledger.py): a run whose claim another run took over neither
calls the executor nor records results — before the call, nor when the takeover happens during it — and a step
run with other calls runs them once, its results never the other calls'.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from sglang_sim.tools import write_catalogue
from storage.conversations import ToolMarkers, output_message
from storage.reader import raw_duplicates, read_committed
from testing.datasets import write_jsonl
from testing.fleet import WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.state.ledger import Ledger
from thinkfleet.template import load_tokenizer
from thinkfleet.turns import answer_message
from workers.tool_exec import (
    PENDING,
    TRUSTED_ENV,
    ToolExecError,
    ToolExecutor,
    ToolFenced,
    calls_digest,
    executed_results,
    record_field,
)

if TYPE_CHECKING:
    from testing.services import RedisServer

CONVERSATIONS, TURNS, KILLS = 6, 2, 4
#: Many distinct calls (a regenerated step rarely draws the same ones again), most answers calling.
TOOLS = [("calculator", {"expression": f"{a} * {a + 1}"}) for a in range(24)]
SIM_CONTENT = {"tool_call_share": 0.75, "length_median_tokens": 40.0, "max_tool_calls": 2}
#: Logs every request (its call ids) and answers each call with what it was asked: a result says which call it
#: answers. While a ``.hold`` file is next to it, the first call to find it (``.held``) waits until it is gone.
EXECUTOR = """
import json, os, pathlib, time
HERE = pathlib.Path(__file__)

def execute(request):
    with open(__file__ + ".calls", "a") as f:
        f.write(json.dumps([call["id"] for call in request["calls"]]) + "\\n")
    hold = HERE.with_suffix(".hold")
    if hold.exists():
        try:
            os.close(os.open(HERE.with_suffix(".held"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            while hold.exists():
                time.sleep(0.05)
    return [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in request["calls"]]
"""


@dataclass
class KilledRun:
    settings: Settings
    client: redis.Redis
    job: str
    tok_dir: Path
    fp_dir: Path
    executor_log: Path
    restarts: int
    #: The paused worker's executor records as they were while it was stopped (field → record).
    frozen: dict[str, dict[str, Any]]
    zombie_log: Path


def _rows() -> list[dict[str, Any]]:
    rows = []
    for c in range(CONVERSATIONS):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You compute with a calculator tool."}]
        for t in range(TURNS):
            msgs += [
                {"role": "user", "content": f"Chat {c}, question {t}: what is {c + t} times {c + t + 1}?"},
                {"role": "assistant", "content": f"the dataset's answer {t}"},
            ]
        rows.append({"id": f"c{c}", "messages": msgs})
    return rows


@pytest.fixture(scope="module")
def killed_run(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    """The job on three workers: ``w-zombie`` alone first, SIGSTOPped during its first executor call (before its
    record) and continued once every step it held was stored by the others — its call's record must stay a
    pending mark; ``w0`` and ``w1``, SIGKILLed four times between them after a record (each restarted)."""
    tmp_path = tmp_path_factory.mktemp("tool-runs")
    logs = tmp_path / "logs"
    logs.mkdir()
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    settings = isolated_settings(redis_server.url(0), str(tmp_path / "out"))
    keys = settings.keys
    client = redis.Redis.from_url(settings.redis_url)
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok_dir)), "kimi", TOOLS)
    executor = tmp_path / "counting_tools.py"
    executor.write_text(EXECUTOR)
    spec = f"{executor}:execute"
    data = write_jsonl(tmp_path / "chat.jsonl", _rows())
    job = "tool-runs"
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "1000", "--sample-per-request"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    with simulator(logs, *sim_args) as sim:
        # Deaths here are the test's, not the prompts': a step killed twice must not become a suspect.
        env = fast_env(settings, sim, max_inflight=4, lease_s=3, reaper_interval_s=0.5, max_deliveries=20)
        env.update({TRUSTED_ENV: spec, failpoints.DIR_ENV: str(fp_dir)})
        env.pop(failpoints.TIMES_ENV, None)
        killing = {**env, failpoints.ENV: "after_tool_record=kill", failpoints.TIMES_ENV: str(KILLS)}
        # The zombie's held call must not time out (and be tried again) while it is stopped.
        zombie = WorkerProcess("w-zombie", {**env, "THINKFLEET_TOOL_TIMEOUT_S": "600"}, logs).start()
        workers = [zombie]
        restarts = 0
        hold, held = executor.with_suffix(".hold"), executor.with_suffix(".held")
        hold.touch()
        try:
            submitted = producer_cli(
                settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
                "--no-progress", "--max-new-tokens", "300", "--context-length", "131072", "--turns", "all",
                "--tool-results", "executor", "--tool-executor", spec, "--max-tool-steps", "6", "--json",
                in_process=True,
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            # The zombie alone, until its first executor call is under way (its pending mark recorded); then it is
            # stopped (a GC pause, a frozen VM) and the call may return — it will once the zombie is continued.
            wait_until(held.exists, 240, what="w-zombie's first executor call")
            assert zombie.proc is not None
            os.kill(zombie.proc.pid, signal.SIGSTOP)
            wait_until(zombie.stopped, 60, what="w-zombie stopped")
            hold.unlink()
            held_steps = in_flight(client, keys, job, zombie.name)
            records = {k.decode(): json.loads(v) for k, v in client.hgetall(keys.tool_calls(job)).items()}
            frozen = {f: r for f, r in records.items() if r.get("worker") == zombie.name}
            assert frozen and all(r.get(PENDING) for r in frozen.values()), records
            workers += [WorkerProcess(f"w{i}", killing, logs).start() for i in range(2)]

            def settled() -> bool:
                # A killed worker comes back under its name (its claims are let go at start, its steps run again);
                # the zombie comes back once the others stored every step it held.
                nonlocal restarts
                for w in workers[1:]:
                    if not w.alive():
                        w.start()
                        restarts += 1
                if zombie.stopped() and not client.smismember(keys.done(job), list(held_steps)).count(0):
                    zombie.cont()
                p = job_progress(client, keys, job)
                kills = sum((fp_dir / f"failpoint-after_tool_record-{n}").exists() for n in range(KILLS))
                fenced = int(client.hget(keys.counters(job), "fenced") or 0)
                finished = p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]
                return kills == KILLS and not zombie.stopped() and fenced > 0 and finished

            wait_until(settled, 300, what="every step of the agentic job, after four kills and a pause")
            yield KilledRun(
                settings, client, job, tok_dir, fp_dir, Path(f"{executor}.calls"), restarts, frozen, zombie.log_path
            )
        finally:
            hold.unlink(missing_ok=True)
            zombie.cont()
            for w in workers:
                w.terminate()
            client.close()


def _answers(run: KilledRun) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.turn_answers(run.job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def test_a_step_regenerated_after_its_tool_ran_runs_its_own_calls_and_never_ends_tool_error(
    killed_run: KilledRun,
) -> None:
    run = killed_run
    assert run.restarts >= KILLS, "every kill took a worker down (and it came back)"
    assert dead_letters(run.client, run.settings.keys, run.job) == {}
    assert raw_duplicates(run.settings.output_uri, run.job).num_rows == 0
    answers = _answers(run)
    ended = {pid: a for pid, a in answers.items() if a.get("chain_end") == "tool_error"}
    # No executor failed: a chain may end tool_error only where the step's live run drew exactly the calls the
    # paused zombie had called (its outcome unknown, never recorded: not called a second time).
    for pid, a in ended.items():
        field = record_field(pid, int(a.get("revision") or 0), calls_digest(answer_message(a)["tool_calls"]))
        assert field in run.frozen and "no recorded outcome" in a["tool_error"], (pid, a.get("tool_error"))
    counters = run.client.hgetall(run.settings.keys.counters(run.job))
    assert int(counters.get(b"chains_ended:tool_error", 0)) == len(ended)

    # Every step's recorded results answer the calls of the step as stored (decoded from its committed row).
    record = JobRecord.load(run.client, run.settings.keys, run.job)
    assert record is not None
    tok, markers = load_tokenizer(str(run.tok_dir)), ToolMarkers.of(record)
    rows = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, run.job).to_pylist()}
    fed = 0
    for pid, answer in answers.items():
        if not answer.get("tool_results"):
            continue
        row = rows[pid]
        spans = [(s["start"], s["end"]) for s in row["tool_call_spans"]]
        stored = output_message(
            tok,
            row["output_ids"],
            (row["reasoning_start"], row["reasoning_end"]),
            (row["answer_start"], row["answer_end"]),
            spans,
            markers,
        )
        calls = stored["tool_calls"]
        assert answer_message(answer)["tool_calls"] == calls, pid
        asked = [json.loads(m["content"]) for m in answer["tool_results"]]
        assert asked == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls], pid
        assert [m["tool_call_id"] for m in answer["tool_results"]] == [c["id"] for c in calls]
        fed += 1
    assert fed >= 2, "some steps went on with the executor's results"

    # At most once per run: no call id (step, revision, calls) was ever called twice; and a step whose regenerated
    # answer called other tools ran them (two requests for one step revision, different calls).
    requests = [json.loads(line) for line in run.executor_log.read_text().splitlines()]
    ids = [i for request in requests for i in request]
    assert ids and len(ids) == len(set(ids)), Counter(ids).most_common(3)
    per_step = Counter(request[0].split("@")[0] for request in requests)
    assert any(n >= 2 for n in per_step.values()), "a step regenerated after its tool ran called its tools again"


def test_a_worker_paused_after_its_executor_call_records_nothing_once_its_step_was_taken_over(
    killed_run: KilledRun,
) -> None:
    run = killed_run
    records = {k.decode(): json.loads(v) for k, v in run.client.hgetall(run.settings.keys.tool_calls(run.job)).items()}
    # Its executor ran, but what it answered was never recorded: its marks are as they were while it was stopped
    # (the live runs that took its steps over called their own calls, or found the mark and did not call again).
    assert {f: records[f] for f in run.frozen} == run.frozen
    assert all(r.get(PENDING) and "results" not in r for r in run.frozen.values())
    log = run.zombie_log.read_text(errors="replace")
    assert "during its executor call: not recorded" in log, "the zombie came back and was fenced at its record"
    assert int(run.client.hget(run.settings.keys.counters(run.job), "fenced") or 0) >= 1
    # No answer record carries results the zombie got: each step's results answer its stored calls (above), and no
    # record of the zombie's calls holds results.
    for pid, answer in _answers(run).items():
        if answer.get("tool_results"):
            digest = calls_digest(answer_message(answer)["tool_calls"])
            assert record_field(pid, int(answer.get("revision") or 0), digest) not in run.frozen


# -- fencing, with real claims ---------------------------------------------------------------------------------
JOB, WHERE = "fenced-tools", {"conversation": "chat/c0", "turn": 0, "step": 0}


def _call(expression: str) -> list[dict[str, Any]]:
    args = json.dumps({"expression": expression})
    return [{"id": "functions.calculator:0", "function": {"name": "calculator", "arguments": args}}]


def _logged(module: Path) -> list[list[str]]:
    path = Path(f"{module}.calls")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_fenced_run_neither_calls_its_executor_nor_records_its_results(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "tools.py"
    module.write_text(EXECUTOR)
    monkeypatch.setenv(TRUSTED_ENV, "*")
    settings = isolated_settings(redis_server.url(0), str(tmp_path / "out"))
    key = settings.keys.tool_calls(JOB)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(settings.redis_url)
        # Two workers' ledgers; neither beats, so each may take the other's claim over (as after a pause past the
        # lease).
        zombie, live = Ledger(client, settings.keys, "w-zombie"), Ledger(client, settings.keys, "w-live")
        executor = ToolExecutor(f"{module}:execute")
        try:
            # Taken over before the call: the zombie calls nothing, records nothing, and its row is fenced too.
            pid = "chat/c0/t0"
            assert (await zombie.claim(JOB, pid)).state == "new"
            assert (await live.claim(JOB, pid)).state == "stale"
            with pytest.raises(ToolFenced, match="w-live"):
                await executed_results(zombie, executor, JOB, pid, 0, WHERE, _call("2 * 3"))
            assert _logged(module) == [] and await client.hlen(key) == 0
            assert zombie.fence(JOB, pid) is None and pid in await zombie.mark_part(JOB, [pid], "part-of-zombie")
            # The live run, holding the claim, calls once and records under its epoch.
            fed = await executed_results(live, executor, JOB, pid, 0, WHERE, _call("2 * 3"))
            assert [json.loads(m["content"])["arguments"] for m in fed] == ['{"expression": "2 * 3"}']
            assert len(_logged(module)) == 1

            # Taken over during the call: the executor ran, but the zombie's outcome is never recorded; its pending
            # mark stays, so the live run with the same calls does not call again (unknown outcome: tool_error),
            # and with other calls runs its own.
            pid = "chat/c1/t0"
            calls = _call("4 * 5")

            class TakenOverDuringTheCall(ToolExecutor):
                async def run(self, request: dict[str, Any]) -> list[Any]:
                    assert (await live.claim(JOB, pid)).state == "stale"
                    return await super().run(request)

            claim = await zombie.claim(JOB, pid)
            with pytest.raises(ToolFenced, match="not recorded"):
                await executed_results(zombie, TakenOverDuringTheCall(f"{module}:execute"), JOB, pid, 0, WHERE, calls)
            assert len(_logged(module)) == 2
            mark = json.loads(await client.hget(key, record_field(pid, 0, calls_digest(calls))))
            assert mark == {
                PENDING: True,
                "calls": calls_digest(calls),
                "epoch": str(claim.epoch),
                "worker": "w-zombie",
            }
            with pytest.raises(ToolExecError, match="no recorded outcome"):
                await executed_results(live, executor, JOB, pid, 0, WHERE, calls)
            assert len(_logged(module)) == 2
            other = _call("6 * 7")
            fed = await executed_results(live, executor, JOB, pid, 0, WHERE, other)
            assert [json.loads(m["content"])["arguments"] for m in fed] == ['{"expression": "6 * 7"}']
            record = json.loads(await client.hget(key, record_field(pid, 0, calls_digest(other))))
            assert (record["worker"], record["epoch"]) == ("w-live", live.fence(JOB, pid).epoch)  # type: ignore[union-attr]
            assert len(_logged(module)) == 3
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_record_that_failed_is_retried_with_the_outcome_not_a_second_call(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "tools.py"
    module.write_text(EXECUTOR)
    monkeypatch.setenv(TRUSTED_ENV, "*")
    settings = isolated_settings(redis_server.url(0), str(tmp_path / "out"))
    key = settings.keys.tool_calls(JOB)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(settings.redis_url)
        ledger = Ledger(client, settings.keys, "w1")

        class RecordFails(ToolExecutor):
            """While the call runs, the record's hash becomes a string: the record after it fails (WRONGTYPE)."""

            async def run(self, request: dict[str, Any]) -> list[Any]:
                await client.delete(key)
                await client.set(key, "not a hash")
                return await super().run(request)

        executor = RecordFails(f"{module}:execute")
        pid, calls = "chat/c0/t0", _call("8 * 9")
        try:
            assert (await ledger.claim(JOB, pid)).state == "new"
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await executed_results(ledger, executor, JOB, pid, 0, WHERE, calls)
            await client.delete(key)  # Redis is back (the mark went with it)
            # The commit retries the same run: the outcome it kept is recorded, the executor is not called again (a
            # call would break the hash again, and log a second request).
            fed = await executed_results(ledger, executor, JOB, pid, 0, WHERE, calls)
            assert [json.loads(m["content"])["arguments"] for m in fed] == ['{"expression": "8 * 9"}']
            assert len(_logged(module)) == 1
            assert "results" in json.loads(await client.hget(key, record_field(pid, 0, calls_digest(calls))))
            # And a finalize retry of the same run with the same calls reuses the record.
            assert await executed_results(ledger, executor, JOB, pid, 0, WHERE, calls) == fed
            assert len(_logged(module)) == 1
        finally:
            await client.aclose()

    asyncio.run(scenario())
