"""The worker speaks to the SGLang version we deploy (0.5.9) and the current one (0.5.23).

Unit tests of the health gate and the retry path (fake server, no processes), then end to end against
both simulator profiles (``sglang-sim --sglang-version``): NaN stops never reach storage, slow health
answers don't starve the in-flight bound, a 45 s stall loses nothing, 0.5.9 rows carry the retraction
count and a null ``reasoning_tokens``, an id ≥ the vocabulary never reaches ``/generate``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis

from storage.reader import read_committed
from storage.schema import DETERMINISTIC, REASONING_TOKENS
from storage.writer import PartWriter
from testing.fleet import WorkerProcess, dead_letters, free_port, job_progress, wait_until
from testing.harness import (
    fast_env,
    isolated_settings,
    make_prompts,
    post_json,
    producer_cli,
    register_ids,
    sim_stats,
    simulator,
    submit_ids,
)
from testing.record import check_job, record_result
from testing.rows import make_row
from thinkfleet import kimi
from thinkfleet.broker.celery_app import send_tasks as publish
from thinkfleet.settings import Settings
from workers.attempts import RequestAttempts
from workers.client import Probe
from workers.health import HealthGate
from workers.metrics import WorkerMetrics
from workers.sglang import Generation, NanStop, PermanentError, QueueFull, Unanswered

FAST = ("--time-scale", "400")
SERVER_INFO = {"version": "0.5.9", "context_length": 4096, "internal_states": [{}]}


# -- the health gate, against a scripted server ------------------------------------------------------
class ScriptedServer:
    """``probe_health`` answers from a script of (state, seconds); the last entry repeats."""

    base_url = "http://scripted"

    def __init__(self, *script: tuple[str, float]) -> None:
        self.script = deque(script)
        self.probes = 0

    async def probe_health(self, timeout_s: float | None = None) -> Probe:
        self.probes += 1
        state, seconds = self.script[0] if len(self.script) == 1 else self.script.popleft()
        await asyncio.sleep(seconds)
        return Probe(state, f"scripted {state}", seconds)

    async def get_json(self, path: str) -> dict[str, Any]:
        return {"model_path": "/m"} if path == "/model_info" else SERVER_INFO


def _gate(server: ScriptedServer, events: list[str] | None = None) -> tuple[HealthGate, WorkerMetrics]:
    metrics = WorkerMetrics("t", 4)
    log = events if events is not None else []
    gate = HealthGate(
        server,  # type: ignore[arg-type]
        interval_s=0.05,
        max_inflight=4,
        on_down=lambda: log.append("down"),
        on_up=lambda: log.append("up"),
        metrics=metrics,
    )
    return gate, metrics


def _sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_failed_probe_does_not_close_the_gate_while_generations_complete() -> None:
    async def scenario() -> tuple[bool, str, float]:
        server = ScriptedServer(("ready", 0.0), ("timeout", 0.3))
        gate, metrics = _gate(server)
        await gate.check()
        assert gate.healthy
        probe = asyncio.ensure_future(gate.check())
        await asyncio.sleep(0.1)
        gate.note_completion()  # a /generate finished while the probe waited
        await probe
        return gate.healthy, gate.state, _sample(metrics, "thinkfleet_health_probes_excused_total")

    healthy, state, excused = asyncio.run(scenario())
    assert healthy and state == "ready" and excused == 1


def test_a_failed_probe_with_no_generation_completing_closes_the_gate() -> None:
    async def scenario() -> tuple[bool, str, list[str], float]:
        events: list[str] = []
        gate, metrics = _gate(ScriptedServer(("ready", 0.0), ("timeout", 0.05)), events)
        gate.note_completion()  # before the probe started: no excuse
        await gate.check()
        await asyncio.sleep(0.01)
        await gate.check()
        state = _sample(metrics, "thinkfleet_server_state", thinkfleet_server_state="unhealthy")
        return gate.healthy, gate.state, events, state

    healthy, state, events, metric = asyncio.run(scenario())
    assert not healthy and state == "unhealthy" and events == ["up", "down"] and metric == 1


@pytest.mark.parametrize(("state", "words"), [("loading", "not ready yet"), ("warming", "warming up")])
def test_loading_and_warming_are_not_ready_yet_not_failures(
    state: str, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[bool, str, float, float]:
        gate, metrics = _gate(ScriptedServer((state, 0.0)))
        await gate.check()
        value = _sample(metrics, "thinkfleet_server_state", thinkfleet_server_state=state)
        probes = _sample(metrics, "thinkfleet_health_probes_total", result=state)
        return gate.healthy, gate.state, value, probes

    with caplog.at_level(logging.INFO, logger="workers.health"):
        healthy, got, value, probes = asyncio.run(scenario())
    assert not healthy and got == state and value == 1 and probes == 1
    lines = [r for r in caplog.records if r.name == "workers.health"]
    assert lines and all(r.levelno == logging.INFO for r in lines), "not ready yet is not a warning"
    assert words in lines[-1].getMessage() and "not ready yet" in lines[-1].getMessage()


def test_a_503_from_a_serving_server_is_unhealthy_not_warming_even_with_completions() -> None:
    async def scenario() -> tuple[bool, str]:
        gate, _ = _gate(ScriptedServer(("ready", 0.0), ("warming", 0.05)))
        await gate.check()
        probe = asyncio.ensure_future(gate.check())
        await asyncio.sleep(0.01)
        gate.note_completion()  # the server's own 503 is its word: no excuse
        await probe
        return gate.healthy, gate.state

    assert asyncio.run(scenario()) == (False, "unhealthy")


def test_a_gate_closed_by_a_stall_reopens_when_a_generation_completes() -> None:
    async def scenario() -> tuple[bool, float]:
        gate, _ = _gate(ScriptedServer(("timeout", 0.0), ("timeout", 30.0)))
        await gate.check()  # closed: the server answers nothing
        assert not gate.healthy
        started = time.monotonic()
        probe = asyncio.ensure_future(gate.check())  # the next probe hangs…
        await asyncio.sleep(0.05)
        gate.note_completion()  # …but an in-flight request comes back: the server answers again
        await asyncio.wait_for(probe, 5)
        return gate.healthy, time.monotonic() - started

    healthy, _ = asyncio.run(scenario())
    assert healthy


def test_the_monitor_probes_more_often_while_closed() -> None:
    async def scenario() -> tuple[int, int]:
        open_server = ScriptedServer(("ready", 0.0))
        gate, _ = _gate(open_server)
        gate.interval_s, gate.closed_interval_s = 0.2, 0.02
        gate.start()
        await asyncio.sleep(0.5)
        await gate.stop()
        closed_server = ScriptedServer(("loading", 0.0))
        gate2, _ = _gate(closed_server)
        gate2.interval_s, gate2.closed_interval_s = 0.2, 0.02
        gate2.start()
        await asyncio.sleep(0.5)
        await gate2.stop()
        return open_server.probes, closed_server.probes

    open_probes, closed_probes = asyncio.run(scenario())
    assert closed_probes > 2 * open_probes


def test_wait_news_ends_at_the_next_completion() -> None:
    async def scenario() -> bool:
        gate, _ = _gate(ScriptedServer(("ready", 0.0)))
        await gate.check()
        waiter = asyncio.ensure_future(gate.wait_news(30))
        await asyncio.sleep(0.05)
        gate.note_completion()
        await asyncio.wait_for(waiter, 5)
        return True

    assert asyncio.run(scenario())


# -- the retry path: NaN stops and silent servers ------------------------------------------------------
class ScriptedGenerate:
    """``generate`` raises or returns from a script; the last entry repeats."""

    def __init__(self, *script: Any) -> None:
        self.script = deque(script)
        self.calls = 0

    async def generate(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str, deadline: float, vocab_size: int | None = None
    ) -> Any:
        self.calls += 1
        item = self.script[0] if len(self.script) == 1 else self.script.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


def _runtime(client: ScriptedGenerate, **settings: Any) -> RequestAttempts:
    """The request attempts of a worker that is not draining; the gate is set by the test, once running."""
    s = Settings(retry_base_s=0.001, retry_max_backoff_s=0.001, max_inflight=4, **settings)
    return RequestAttempts(s, client, None, WorkerMetrics("t", 4), draining=lambda: False)  # type: ignore[arg-type]


GEN = Generation([1, 163586], "stop", "163586", 3, 2, 0, None, 0, "default", None, "r")
TASK = SimpleNamespace(task_id="job/p1", prompt_id="p1", job="job")


def _run_generate(rt: RequestAttempts) -> Any:
    async def go() -> Any:
        rt.gate, _ = _gate(ScriptedServer(("ready", 0.0)))
        await rt.gate.check()
        rt.gate.start()  # a failed attempt waits for its next verdict (ready: the retry counts)
        try:
            return await rt.run(TASK, [1, 2, 163606], {"max_new_tokens": 8})  # type: ignore[arg-type]
        finally:
            await rt.gate.stop()

    return asyncio.run(go())


def test_a_nan_stop_is_retried_and_the_clean_answer_kept() -> None:
    client = ScriptedGenerate(NanStop("NaN"), GEN)
    rt = _runtime(client)
    gen, attempts, _ = _run_generate(rt)
    assert gen is GEN and attempts == 2
    assert _sample(rt.metrics, "thinkfleet_retried_total", error_class="nan_stop") == 1


def test_nan_stops_until_retries_run_out_dead_letter_as_nan_stop() -> None:
    client = ScriptedGenerate(NanStop("NaN"))
    rt = _runtime(client, retry_max_attempts=3)
    with pytest.raises(PermanentError) as caught:
        _run_generate(rt)
    assert caught.value.error_class == "nan_stop", "its own class, not retries_exhausted:nan_stop"
    assert caught.value.attempts == 3 and client.calls == 3  # type: ignore[attr-defined]


def test_other_faults_still_exhaust_as_retries_exhausted() -> None:
    """A 503 on a server whose health probes pass: each retry counts, and the last one dead-letters."""
    client = ScriptedGenerate(QueueFull("503"))
    rt = _runtime(client, retry_max_attempts=3)
    with pytest.raises(PermanentError) as caught:
        _run_generate(rt)
    assert caught.value.error_class == "retries_exhausted:queue_full" and client.calls == 3


def test_an_unanswered_request_waits_for_the_gates_verdict_before_its_retry() -> None:
    """A request nobody answered (and no other completed meanwhile) waits for the next probe verdict:
    when the gate closes, the prompt is handed back instead of burning its retries."""
    from workers.runtime import HandBack

    async def go() -> tuple[int, str]:
        client = ScriptedGenerate(Unanswered("no answer"))
        rt = _runtime(client, retry_max_attempts=8, health_interval_s=0.05, health_probe_timeout_s=1)
        rt.gate, _ = _gate(ScriptedServer(("ready", 0.0), ("timeout", 0.1)))
        await rt.gate.check()
        rt.gate.start()
        try:
            await rt.run(TASK, [1, 163606], {"max_new_tokens": 8})  # type: ignore[arg-type]
        except HandBack:
            return client.calls, rt.gate.state
        finally:
            await rt.gate.stop()
        return client.calls, "not handed back"

    calls, state = asyncio.run(go())
    assert state == "unhealthy" and calls <= 2


# -- storage: the new column and nulls -----------------------------------------------------------------
def test_parts_without_the_deterministic_column_read_back_as_null(tmp_path: Path) -> None:
    from storage import layout
    from storage.report import summarize
    from storage.schema import rows_to_table

    writer = PartWriter(str(tmp_path), "w1")
    writer.write(
        "job", "d", [make_row("new", dataset="d", deterministic=False, reasoning_tokens=None, num_retractions=3)]
    )
    # A part written before the column existed (schema version 1): same rows, no `deterministic`.
    old = rows_to_table([make_row("old", dataset="d")])
    path = layout.locate(str(tmp_path)).path(writer.part_name("job", "d"))
    old = old.drop_columns([DETERMINISTIC]).replace_schema_metadata({b"thinkfleet.schema_version": b"1"})
    pq.write_table(old, path)
    table = read_committed(str(tmp_path), "job")
    got = {r["prompt_id"]: r for r in table.to_pylist()}
    assert got["new"][DETERMINISTIC] is False and got["new"][REASONING_TOKENS] is None
    assert got["new"]["num_retractions"] == 3
    assert got["old"][DETERMINISTIC] is None
    assert summarize("job", table)["rows"] == 2, "the report reads nulls"


# -- end to end, against both simulator profiles ------------------------------------------------------
PROFILES = ("0.5.9", "0.5.23")
#: CI runs these end-to-end checks on the deployed release; the current one by ``-m slow`` (its wire differences
#: are checked without a job in tests/test_sim_versions.py).
E2E_PROFILES = ("0.5.9", pytest.param("0.5.23", marks=pytest.mark.slow))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path


def _metrics(client: redis.Redis, settings: Settings, worker: str) -> dict[str, float]:
    """A worker's Prometheus samples (summed over label sets), from the port it registered in Redis."""
    port = json.loads(client.hget(settings.keys.workers, worker))["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and line[0] != "#":
            name, _, value = line.rpartition(" ")
            key = name if name.startswith("thinkfleet_server_state") else name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _prompt_of(rid: str) -> str:
    return rid.split("/")[1]  # {job}/{prompt_id}/r{revision}/a{attempt}-{hex}


def _attempt_of(rid: str) -> int:
    return int(rid.split("/")[3].split("-")[0][1:])


@pytest.mark.parametrize("version", E2E_PROFILES)
def test_nan_stops_are_retried_and_never_stored(redis_url: str, workdir: Path, version: str) -> None:
    """3 % of generations end in SGLang's NaN stop (last id overwritten by a stop id): each is retried,
    every stored row is byte-exact, no NaN row is stored. Rows carry what this release reports."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    started = time.monotonic()
    with simulator(workdir / "logs", "--time-scale", "400", "--sglang-version", version, "--nan-rate", "0.03") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=16), workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            job = submit_ids(settings, "nan", make_prompts(400, seed=11), max_new_tokens=512)
            wait_until(lambda: job_progress(client, settings.keys, "nan")["done"] == 400, 240, what="400 rows")
            stats = sim_stats(sim)
        finally:
            worker.terminate()
    nan_rids = list(stats["nan_rids"])
    outcome = check_job(settings, "nan", job.prompts, job.sampling_params)
    rows = {
        r["prompt_id"]: r
        for r in read_committed(
            settings.output_uri,
            "nan",
            columns=["prompt_id", "attempt", "finish_matched", "reasoning_tokens", "num_retractions", DETERMINISTIC],
        ).to_pylist()
    }
    nan_stored = [r for r in rows.values() if r["finish_matched"] == "NaN happened"]
    record_result(
        f"NaN stops (3 %), SGLang {version}",
        outcome,
        faults="3 % of generations end in a NaN stop (last id overwritten)",
        wall_s=time.monotonic() - started,
        notes=f"{len(nan_rids)} NaN answers seen, {len(nan_stored)} stored; each retried (class nan_stop)",
    )
    outcome.assert_clean()
    assert nan_rids, "the scenario produced NaN stops"
    assert not nan_stored
    for rid in nan_rids:  # the NaN attempt was thrown away: a later attempt's row is the stored one
        assert rows[_prompt_of(rid)]["attempt"] > _attempt_of(rid)
    assert all(r["num_retractions"] is not None for r in rows.values()), "the retraction count, by either name"
    if version == "0.5.9":
        assert all(r["reasoning_tokens"] is None for r in rows.values()), "unreported: null, never 0"
    else:
        assert all(r["reasoning_tokens"] for r in rows.values())
    # The job sends sampling_seed; the server runs without --enable-deterministic-inference.
    assert all(r[DETERMINISTIC] is False for r in rows.values())
    assert client.hget(settings.keys.counters("nan"), "nondeterministic_seeds") == b"1"
    assert worker.log_path.read_text().count("NONDETERMINISTIC SEEDS") == 1, "one loud warning per job"
    status = json.loads(producer_cli(settings, "status", "nan", "--json", in_process=True).stdout)
    assert status["nondeterministic_seeds"] == 1


def test_an_id_beyond_the_vocabulary_never_reaches_the_server(redis_url: str, workdir: Path) -> None:
    """SGLang reports no vocabulary size: the job record's ``vocab_size`` bounds the ids."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(6, seed=3)
    prompts["oov"] = [*prompts["p00000"][:-1], kimi.VOCAB_SIZE, kimi.THINK_START]
    with simulator(workdir / "logs", *FAST, "--enable-deterministic-inference") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim), workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            _, tasks = register_ids(settings, "vocab", prompts)
            client.hset(settings.keys.job("vocab"), "vocab_size", json.dumps(kimi.VOCAB_SIZE))
            publish(settings, tasks)
            wait_until(
                lambda: sum(job_progress(client, settings.keys, "vocab")[k] for k in ("done", "dead")) == 7,
                120,
                what="all resolved",
            )
            sent = {_prompt_of(rid) for rid in sim_stats(sim, rids=True)["rids"]}
        finally:
            worker.terminate()
    dead = dead_letters(client, settings.keys, "vocab")
    assert set(dead) == {"oov"}
    assert dead["oov"]["error_class"] == "invalid_ids" and dead["oov"]["attempts"] == 0
    assert f"prompt id {kimi.VOCAB_SIZE} at position {len(prompts['oov']) - 2}" in dead["oov"]["message"]
    assert "oov" not in sent and len(sent) == 6, "no /generate call carried it"
    table = read_committed(settings.output_uri, "vocab", columns=[DETERMINISTIC]).to_pylist()
    assert len(table) == 6 and all(r[DETERMINISTIC] is True for r in table)
    assert not client.hget(settings.keys.counters("vocab"), "nondeterministic_seeds")


def test_slow_health_answers_keep_the_inflight_bound_full(redis_url: str, workdir: Path) -> None:
    """Every health answer takes 1.5 s, then 6.5 s — past the worker's 3 s probe timeout: probes fail,
    generations keep completing, so the gate stays open and in-flight stays at the bound."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    bound, total = 8, 160
    with simulator(workdir / "logs", "--time-scale", "15", "--health-min-s", "1.5") as sim:
        env = fast_env(settings, sim, max_inflight=bound, health_probe_timeout_s=3)
        worker = WorkerProcess("w1", env, workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            submit_ids(settings, "slowhealth", make_prompts(total, seed=5), max_new_tokens=1024)
            samples: list[tuple[float, dict[str, float], int]] = []
            slowed = False
            while (done := job_progress(client, settings.keys, "slowhealth")["done"]) < total:
                samples.append((time.monotonic(), _metrics(client, settings, "w1"), done))
                if not slowed and done >= total // 4:
                    post_json(f"{sim}/control/health_delay", {"seconds": 5})  # 6.5 s answers
                    slowed = True
                time.sleep(0.1)
            final = _metrics(client, settings, "w1")
        finally:
            worker.terminate()
    full = next(i for i, (_, m, _) in enumerate(samples) if m.get("thinkfleet_inflight_requests") == bound)
    last = max(i for i, (_, _, done) in enumerate(samples) if done <= total - 2 * bound)
    (t0, m0, _), (t1, m1, _) = samples[full], samples[last]
    occupancy = (m1["thinkfleet_inflight_seconds_total"] - m0["thinkfleet_inflight_seconds_total"]) / (
        (t1 - t0) * bound
    )
    probes = {k: v for k, v in final.items() if "probe" in k and k.endswith("_total")}
    print(f"occupancy {occupancy:.3f} over {t1 - t0:.1f} s; {probes}")
    assert occupancy >= 0.9, f"in-flight occupancy {occupancy:.3f} over the steady window"
    assert final.get("thinkfleet_health_probes_excused_total", 0) >= 1, "the slow probes did fail"
    assert final.get("thinkfleet_handed_back_total", 0) == 0
    assert final.get('thinkfleet_server_state{thinkfleet_server_state="ready"}') == 1


def test_a_45s_stall_loses_nothing(redis_url: str, workdir: Path) -> None:
    """The server answers nothing for 45 s (in-flight generations freeze, probes hang): the gate closes
    (probe timeout 10 s here), work is handed back, and the worker resumes when the server answers."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    started = time.monotonic()
    with simulator(workdir / "logs", "--time-scale", "40") as sim:
        env = fast_env(settings, sim, max_inflight=8, health_probe_timeout_s=10)
        worker = WorkerProcess("w1", env, workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            job = submit_ids(settings, "stall", make_prompts(60, seed=9), max_new_tokens=1024)
            wait_until(lambda: job_progress(client, settings.keys, "stall")["done"] >= 10, 120, what="10 rows")
            post_json(f"{sim}/control/stall", {"seconds": 45})
            stall_end = time.monotonic() + 45
            before = job_progress(client, settings.keys, "stall")["done"]
            wait_until(lambda: time.monotonic() >= stall_end, 60, what="the stall's end")
            during = job_progress(client, settings.keys, "stall")["done"]
            wait_until(lambda: job_progress(client, settings.keys, "stall")["done"] > during, 120, what="a new row")
            recovery_s = time.monotonic() - stall_end
            wait_until(lambda: job_progress(client, settings.keys, "stall")["done"] == 60, 240, what="60 rows")
            final = _metrics(client, settings, "w1")
        finally:
            worker.terminate()
    outcome = check_job(settings, "stall", job.prompts, job.sampling_params)
    record_result(
        "SGLang stalls 45 s (answers nothing)",
        outcome,
        faults="one 45 s stall: no byte sent, generations frozen, health probes hang",
        recovery_s=[recovery_s],
        wall_s=time.monotonic() - started,
        notes=f"probe timeout 10 s; {int(final.get('thinkfleet_handed_back_total', 0))} prompts handed back; "
        "recovery = stall end → next row stored",
    )
    handed_back = final.get("thinkfleet_handed_back_total")
    print(f"stall: {before} rows before, {during} at its end, recovery {recovery_s:.1f} s, {handed_back} handed back")
    outcome.assert_clean()
    assert "is unhealthy" in worker.log_path.read_text(), "the stall closed the gate"


def test_a_loading_then_warming_server_is_not_ready_yet_not_a_failure(redis_url: str, workdir: Path) -> None:
    """The worker starts before SGLang: connection refused (loading), then 503s (warming up) — two "not
    ready yet" lines, no failure — and it consumes once the server is ready."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    port = free_port()
    env = fast_env(settings, f"http://127.0.0.1:{port}")
    worker = WorkerProcess("w1", env, workdir / "logs").start()
    sim_log = open(workdir / "logs" / "sim.log", "ab")  # noqa: SIM115
    sim = None
    try:
        worker.wait_ready(client, settings.keys)
        job = submit_ids(settings, "late", make_prompts(5, seed=2))
        # (The worker logs a closed gate again after 5 s: the first line comes before Celery's logging is up.)
        sim = subprocess.Popen(
            [sys.executable, "-m", "sglang_sim.cli", "--port", str(port), *FAST, "--load-s", "6", "--warmup-s", "2"],
            stdout=sim_log,
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: job_progress(client, settings.keys, "late")["done"] == 5, 120, what="5 rows")
        metrics = _metrics(client, settings, "w1")
    finally:
        worker.terminate()
        if sim is not None:
            sim.kill()
            sim.wait(10)
        sim_log.close()
    log = worker.log_path.read_text()
    assert "is not ready yet (for 5s): connection refused" in log
    assert "is not ready yet: warming up" in log
    assert "is unhealthy" not in log, "loading and warming are not failures"
    assert metrics.get("thinkfleet_health_probes_total", 0) > 2
    outcome = check_job(settings, "late", job.prompts, job.sampling_params)
    outcome.assert_clean()


@pytest.mark.parametrize("version", E2E_PROFILES)
def test_the_context_boundary_is_the_servers(redis_url: str, workdir: Path, version: str) -> None:
    """prompt + max_new_tokens == context: 0.5.9 refuses it (``>=``), so the worker never sends it;
    0.5.23 accepts it (``>``), so the worker sends and stores it. 0.5.23 runs without ``--context-length``
    (``/server_info.context_length`` null): the length comes from ``/v1/models`` ``max_model_len``."""
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(4, seed=4)
    body = make_prompts(1, seed=8, length=4000)["p00000"]
    prompts["at-limit"] = [*body[: 2048 - 1], kimi.THINK_START]  # 2,048 ids + 2,048 new = the 4,096 context
    reported = () if version == "0.5.9" else ("--no-report-context-length",)
    with simulator(workdir / "logs", *FAST, "--sglang-version", version, "--context-length", "4096", *reported) as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim), workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            job = submit_ids(settings, "edge", prompts)
            wait_until(
                lambda: sum(job_progress(client, settings.keys, "edge")[k] for k in ("done", "dead")) == 5,
                120,
                what="all resolved",
            )
            sent = {_prompt_of(rid) for rid in sim_stats(sim, rids=True)["rids"]}
        finally:
            worker.terminate()
    refused = {"at-limit"} if version == "0.5.9" else set()
    outcome = check_job(settings, "edge", job.prompts, job.sampling_params, expected_dead=refused)
    outcome.assert_clean()
    assert ("at-limit" in sent) == (version != "0.5.9")
    if refused:
        dead = dead_letters(client, settings.keys, "edge")["at-limit"]
        assert dead["error_class"] == "context_overflow" and dead["attempts"] == 0
        assert "2048 tokens + max_new_tokens 2048 = 4096 tokens >= the model's context length" in dead["message"]


@pytest.mark.parametrize(("version", "status"), [("0.5.9", 503), ("0.5.23", 400)])
def test_aborts_retry_on_5xx_and_dead_letter_on_4xx(redis_url: str, workdir: Path, version: str, status: int) -> None:
    settings = isolated_settings(redis_url, str(workdir / "out"))
    client = redis.Redis.from_url(redis_url)
    # A tenth of the generations: which ones is drawn per request id (a claim's epoch is in it), and at 0.05 one
    # run in 60 drew none of the 80 (0.95^80); at 0.1, one in 4,500.
    aborts = ("--abort-rate", "0.1", "--abort-status-code", str(status))
    with simulator(workdir / "logs", *FAST, "--sglang-version", version, *aborts) as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=8), workdir / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            job = submit_ids(settings, "abort", make_prompts(80, seed=6), max_new_tokens=512)
            wait_until(
                lambda: sum(job_progress(client, settings.keys, "abort")[k] for k in ("done", "dead")) == 80,
                180,
                what="all resolved",
            )
            aborted = {_prompt_of(rid) for rid in sim_stats(sim)["abort_rids"]}
        finally:
            worker.terminate()
    assert aborted, "the scenario aborted generations"
    expected_dead = aborted if status == 400 else set()
    outcome = check_job(settings, "abort", job.prompts, job.sampling_params, expected_dead=expected_dead)
    outcome.assert_clean()
    dead = dead_letters(client, settings.keys, "abort")
    assert set(dead) == expected_dead
    for record in dead.values():  # a 4xx abort is the request's fault: dead-lettered at once, with its message
        assert record["error_class"] == "invalid_request" and record["attempts"] == 1 and record["message"]
