"""A context-overflow dead letter re-reads the server's context first: a restarted server is seen.

The health gate reads /model_info, /server_info and /v1/models only when it (re)opens. A server restarted
with a longer context inside one health interval never closes it, so the worker kept the old context length
and ``producer retry`` of the context-overflow dead letters dead-lettered them all again (268 of 268). Now a
prompt about to be dead-lettered for its length has the info read once more (``HealthGate.refresh_info``,
shared by every prompt refused under the same info), and the server's own 400 for a length it refuses gets
one more attempt when the re-read context is longer (``RequestAttempts``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from testing.record import check_job, record_result
from thinkfleet.settings import Settings
from workers.attempts import RequestAttempts
from workers.health import REREAD_MIN_AGE_S, HealthGate
from workers.metrics import WorkerMetrics
from workers.sglang import Generation, PermanentError, ServerInfo

N_LONG = 20


def test_retry_after_a_restart_with_a_longer_context_inside_one_health_interval_stores_them(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a worker whose health gate probes only every 10 minutes, and a 4,096-token server: 20 prompts
    # too long for it are dead-lettered (refused before they were sent).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(10)
    for i, ids in enumerate(make_prompts(N_LONG, seed=1, length=5000).values()):
        prompts[f"long{i:03d}"] = ids  # ≥ 2,500 ids + 2,048 new > 4,096
    long_ids = {pid for pid in prompts if pid.startswith("long")}
    sim = SimulatorProcess("--time-scale", "400", "--context-length", "4096")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url, health_interval_s=600), tmp_path)
    started = time.monotonic()
    try:
        worker.start().wait_consuming().wait_ready(client, keys)
        job = submit_ids(settings, "reread", prompts)
        wait_until(lambda: sum(job_progress(client, keys, "reread")[k] for k in ("done", "dead")) == 30, 120)
        dead = dead_letters(client, keys, "reread")
        assert set(dead) == long_ids and {d["error_class"] for d in dead.values()} == {"context_overflow"}
        # When the server restarts with its full context while the worker's gate stays open (no probe saw it go).
        closed = worker.gate_closures()
        before_restart = worker.log_path.stat().st_size
        sim.kill()
        sim.args = ["--time-scale", "400"]
        sim.start()
        # (The gate reads the info again at most once per REREAD_MIN_AGE_S, so a stream of refused prompts costs one
        # read: a restart that fast is by design not seen. A real one takes far longer; the simulator's can take
        # 0.5 s, and the worker read its info just before the first refusals.)
        time.sleep(REREAD_MIN_AGE_S + 0.1)
        retry = producer_cli(settings, "retry", "reread", "--json", in_process=True)
        assert retry.returncode == 0, retry.stderr
        assert set(json.loads(retry.stdout)["prompt_ids"]) == long_ids
        # Then every retried prompt is stored: the worker read the context again before dead-lettering.
        wait_until(lambda: sum(job_progress(client, keys, "reread")[k] for k in ("done", "dead")) == 30, 180)
        assert job_progress(client, keys, "reread")["done"] == 30, dead_letters(client, keys, "reread")
        assert worker.gate_closures() == closed, "the gate never closed: only the re-read saw the restart"
    finally:
        worker.terminate()
        sim.kill()
    log = worker.log_path.read_bytes()
    rereads = log[:before_restart].count(b"re-reading the server's info")
    assert rereads < N_LONG, "refusals of prompts truly too long share reads (at most one a second)"
    assert log[before_restart:].count(b"re-reading the server's info") == 1, "one read for the 20 retried"
    outcome = check_job(settings, "reread", job.prompts, job.sampling_params)
    record_result(
        "context dead letters retried after a server restart with a longer context",
        outcome,
        f"{N_LONG} of {len(prompts)} prompts dead-lettered (context overflow at 4,096); server restarted with "
        "its full context inside one health interval; `producer retry`",
        [],
        time.monotonic() - started,
        notes="the refused prompt has the server's info read once more (one read shared by all 20)",
    )
    outcome.assert_clean()
    assert not dead_letters(client, keys, "reread")


# -- units: the shared re-read, and the server's own 400 ---------------------------------------------------
def _info(context: int) -> ServerInfo:
    return ServerInfo("m", "default", None, None, context, version="0.5.9")


class InfoServer:
    """``get_json`` answers /model_info, /server_info and /v1/models with the current ``context``."""

    base_url = "http://sim"

    def __init__(self, context: int) -> None:
        self.context = context
        self.reads = 0

    async def get_json(self, path: str) -> dict[str, Any]:
        if path == "/model_info":
            self.reads += 1
            await asyncio.sleep(0.01)
            return {"model_path": "m"}
        if path == "/server_info":
            return {"version": "0.5.9", "context_length": self.context}
        return {"data": [{"max_model_len": self.context}]}


def test_refresh_info_is_one_read_for_every_prompt_refused_under_the_same_info() -> None:
    async def scenario() -> tuple[int, list[int | None]]:
        server = InfoServer(4096)
        gate = HealthGate(server, 600, 4)  # type: ignore[arg-type]
        await gate._read_info()
        seen = gate.info
        gate._info_at -= 2 * REREAD_MIN_AGE_S  # read a while ago
        server.context = 262_144  # restarted with its full context; the gate has not noticed
        results = await asyncio.gather(*(gate.refresh_info(seen) for _ in range(20)))
        later = await gate.refresh_info(seen)  # refused under the old info after the read: no new read
        again = await gate.refresh_info(gate.info)  # refused under info read just now: not read again
        return server.reads, [r.context_length if r else None for r in [*results, later, again]]

    reads, contexts = asyncio.run(scenario())
    assert reads == 2, "the preflight read and one re-read"
    assert contexts == [262_144] * 22


GEN = Generation([1, 163586], "stop", "163586", 3, 2, 0, None, 0, "default", None, "r")
TASK = SimpleNamespace(task_id="job/p1", prompt_id="p1", job="job")


class Gate:
    """What RequestAttempts asks of the health gate; ``refresh_info`` hands out ``fresh`` once asked."""

    healthy = True

    def __init__(self, info: ServerInfo, fresh: ServerInfo) -> None:
        self.info, self.fresh, self.refreshed = info, fresh, 0

    async def refresh_info(self, seen: ServerInfo | None) -> ServerInfo | None:
        self.refreshed += 1
        self.info = self.fresh
        return self.info

    def note_completion(self) -> None:
        pass

    def report_failure(self) -> None:
        pass

    def alive_since(self, t: float) -> bool:
        return True


class Scripted:
    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        item = self.script[min(self.calls - 1, len(self.script) - 1)]
        if isinstance(item, BaseException):
            raise item
        return item


def _attempts(client: Scripted, gate: Gate) -> RequestAttempts:
    s = Settings(retry_base_s=0.001, retry_max_backoff_s=0.001, max_inflight=4)
    return RequestAttempts(s, client, gate, WorkerMetrics("t", 4), draining=lambda: False)  # type: ignore[arg-type]


OVERFLOW = PermanentError("context_overflow", "The input (5000 tokens) is longer than the model's context length", 400)


def test_the_servers_own_length_refusal_is_retried_once_when_the_context_grew() -> None:
    client, gate = Scripted(OVERFLOW, GEN), Gate(_info(4096), _info(262_144))
    gen, attempts, _ = asyncio.run(_attempts(client, gate).run(TASK, [1, 2, 163606], {"max_new_tokens": 8}))  # type: ignore[arg-type]
    assert gen is GEN and attempts == 2 and gate.refreshed == 1


@pytest.mark.parametrize("fresh", [4096, 2048])
def test_the_servers_own_length_refusal_is_dead_lettered_when_the_context_did_not_grow(fresh: int) -> None:
    client, gate = Scripted(OVERFLOW, GEN), Gate(_info(4096), _info(fresh))
    with pytest.raises(PermanentError) as caught:
        asyncio.run(_attempts(client, gate).run(TASK, [1, 2, 163606], {"max_new_tokens": 8}))  # type: ignore[arg-type]
    assert caught.value.error_class == "context_overflow" and client.calls == 1 and gate.refreshed == 1


def test_a_second_length_refusal_after_the_re_read_is_dead_lettered() -> None:
    client, gate = Scripted(OVERFLOW), Gate(_info(4096), _info(262_144))
    with pytest.raises(PermanentError):
        asyncio.run(_attempts(client, gate).run(TASK, [1, 2, 163606], {"max_new_tokens": 8}))  # type: ignore[arg-type]
    assert client.calls == 2 and gate.refreshed == 1
