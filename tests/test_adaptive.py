"""The in-flight bound chosen from the server (workers/adaptive.py).

The controller is pure: these tests feed it server limits and load samples on their own clock and read its
moves (no wall clock, no I/O). The limiter is the asyncio side the request attempts hold. The last test runs
a real worker in ``inflight_mode=auto`` against the simulator over HTTP, through a server restart."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import requests

from producer.bounds import inflight_bounds
from testing.fleet import WorkerProcess, free_port, job_progress, wait_for_port, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from workers.adaptive import (
    START_TOKENS_PER_REQUEST,
    ControllerConfig,
    InflightController,
    LoadSample,
    LoadWatcher,
    NotServed,
    ResizableLimiter,
    ServerError,
    ServerLimits,
    parse_load,
    parse_retractions,
)
from workers.app import prefetch_for

INTERVAL_S = 5.0
#: Samples per decision, as the worker's watcher reads (every interval / 4).
READS = 4


class Feed:
    """Drives a controller the way the worker's watcher does: READS samples per interval."""

    def __init__(self, controller: InflightController) -> None:
        self.controller = controller
        self.t_s = 0.0
        self.retractions = 0
        self.bounds: list[int] = []

    def interval(self, running: float, waiting: float, inflight: float | None = None, retracted: int = 0) -> None:
        """One interval in which the server runs ``running`` and queues ``waiting`` (of every client)."""
        self.retractions += retracted
        for _ in range(READS):
            self.read(int(running), int(waiting), self.controller.bound if inflight is None else int(inflight))
        self.bounds.append(self.controller.bound)

    def full(self, runs: float) -> None:
        """An interval in which the server runs at most ``runs`` of ours and queues the rest of the bound."""
        for _ in range(READS):
            bound = self.controller.bound
            self.read(int(min(runs, bound)), int(max(0.0, bound - runs)), bound)
        self.bounds.append(self.controller.bound)

    def read(self, running: int, waiting: int, inflight: int) -> None:
        self.t_s += INTERVAL_S / READS
        self.controller.observe(LoadSample(self.t_s, inflight, running, waiting, None, None, self.retractions))


def started(cap: int = 512, slots: int | None = 256, kv: int | None = None) -> Feed:
    controller = InflightController(cap, ControllerConfig(interval_s=INTERVAL_S))
    controller.reset(ServerLimits(slots, kv, 262_144), 0.0)
    return Feed(controller)


# -- start -------------------------------------------------------------------------------------------------
def test_the_bound_starts_from_the_servers_limits_and_never_above_the_cap() -> None:
    assert started(cap=512, slots=256).controller.bound == 256
    assert started(cap=100, slots=256).controller.bound == 100
    assert started(cap=512, slots=None).controller.bound == 512  # a server that reports nothing: the cap
    kv = started(cap=512, slots=256, kv=600_000).controller
    assert kv.bound == 600_000 // START_TOKENS_PER_REQUEST  # what its KV holds of ~8k-token requests
    assert kv.kind == "server_limits" and "max_running_requests=256" in kv.reason


def test_a_restarted_server_starts_the_bound_again_from_its_new_limits() -> None:
    feed = started(slots=256)
    for _ in range(30):
        feed.full(runs=200)
    feed.controller.reset(ServerLimits(64, None, None), feed.t_s)
    assert feed.controller.bound == 64 and feed.controller.moves[-1].kind == "server_limits"


# -- steering ----------------------------------------------------------------------------------------------
def test_a_full_server_brings_the_bound_down_to_what_it_runs_plus_a_short_queue_and_holds_it() -> None:
    # Given a server that runs 50 whatever it is sent (its KV is full)
    feed = started(slots=512)
    # When the worker offers it more for two minutes
    for _ in range(24):
        feed.full(runs=50)
    # Then the bound comes down to 50 plus a queue of a few, and stays there
    assert 50 < feed.controller.bound <= 50 + 8
    assert feed.controller.kind == "server_full"
    moves_before = len(feed.controller.moves)
    for _ in range(60):
        feed.full(runs=50)
    assert len(feed.controller.moves) == moves_before  # steady server, steady bound


def test_a_server_that_takes_everything_is_offered_more_up_to_its_slots_and_the_cap() -> None:
    # Given a bound started low (a small KV estimate) on a server that admits all it gets
    feed = started(cap=512, slots=100, kv=20 * START_TOKENS_PER_REQUEST)
    assert feed.controller.bound == 20
    # When every request runs at once, interval after interval
    for _ in range(60):
        bound = feed.controller.bound
        feed.interval(running=bound, waiting=0)
    # Then the bound rose to the server's slots plus a short queue, never above it
    assert 100 < feed.controller.bound <= 100 + 8
    assert max(feed.bounds) <= 108
    capped = started(cap=60, slots=100, kv=20 * START_TOKENS_PER_REQUEST)
    for _ in range(60):
        capped.interval(running=capped.controller.bound, waiting=0)
    assert 57 <= capped.controller.bound <= 60 and max(capped.bounds) <= 60  # within the dead band of the cap


def test_a_bound_the_work_does_not_fill_is_not_raised() -> None:
    feed = started(cap=512, slots=400, kv=100 * START_TOKENS_PER_REQUEST)
    for _ in range(30):
        feed.interval(running=40, waiting=0, inflight=40)  # only 40 prompts to send
    assert feed.controller.bound <= 100


def test_a_retraction_storm_cuts_the_bound_and_a_few_retractions_do_not() -> None:
    feed = started(slots=512)
    for _ in range(30):
        feed.full(runs=100)
    before = feed.controller.bound
    feed.interval(running=100, waiting=feed.controller.bound - 100, retracted=3)
    assert feed.controller.kind != "retraction_storm"
    feed.interval(running=100, waiting=feed.controller.bound - 100, retracted=40)
    assert feed.controller.kind == "retraction_storm"
    assert feed.controller.bound == int(before * 0.85)


def test_a_retraction_counter_that_went_back_is_a_restart_not_a_storm() -> None:
    feed = started(slots=512)
    feed.retractions = 1000
    for _ in range(4):
        feed.full(runs=100)
    feed.retractions = 0  # the server restarted: its counters start again
    feed.full(runs=100)
    assert all(move.kind != "retraction_storm" for move in feed.controller.moves)


def test_a_wandering_batch_moves_a_settled_bound_rarely_and_seldom_leaves_it_short() -> None:
    # Given a server whose batch wanders between 70 and 130 for minutes at a time, a random walk
    rng = random.Random(3)
    feed = started(slots=512)
    runs, walk = 100.0, []
    for _ in range(360):  # half an hour
        runs = min(130.0, max(70.0, runs + rng.gauss(0, 4)))
        walk.append(runs)
        feed.full(runs=runs)
    # Then over the last quarter of an hour the bound is settled, moved at most twice (on direct evidence: the
    # server starved for half a minute, a 5 % probe each, or ten minutes of headroom) and was below the batch it
    # serves in few intervals
    bound, batch = feed.bounds[-180:], walk[-180:]
    late = [move for move in feed.controller.moves if move.t_s > feed.t_s / 2]
    assert feed.controller.settled
    assert len(late) <= 2, late
    assert all(move.reason.startswith(("server starved", "settled:")) for move in late), late
    assert sum(b < w for b, w in zip(bound, batch, strict=True)) <= 0.05 * len(bound)


def test_a_swinging_kv_bound_batch_leaves_a_settled_bound_still() -> None:
    # Given a KV-bound server (its pool ~95 % used) whose batch swings ±15 % around 100 within a minute or two
    rng = random.Random(5)
    feed = started(slots=512, kv=1_000_000)
    runs = 100.0
    for _ in range(720):  # an hour
        runs = min(130.0, max(70.0, 100 + 0.9 * (runs - 100) + rng.gauss(0, 6)))
        for _ in range(READS):
            bound = feed.controller.bound
            feed.t_s += INTERVAL_S / READS
            sample = LoadSample(feed.t_s, bound, int(min(runs, bound)), int(max(0.0, bound - runs)), 950_000, 1_000_000)
            feed.controller.observe(sample)
        feed.bounds.append(feed.controller.bound)
    # Then over the last half hour the bound is settled and its max - min is within 5 % of it
    late = feed.bounds[-360:]
    assert feed.controller.settled
    assert (max(late) - min(late)) <= 0.05 * statistics.fmean(late), (min(late), max(late))
    assert min(late) >= 100  # above the batch's mean: the swing's peaks find requests ready


def test_a_settled_bound_probes_up_when_the_server_starves_and_follows_a_server_that_keeps_taking_more() -> None:
    # Given a bound settled on a server that runs 100 of ours
    feed = started(slots=512)
    for _ in range(60):
        feed.full(runs=100)
    assert feed.controller.settled
    settled = feed.controller.bound
    # When it can run 104 for a minute (a swing's peak a little above the bound's short queue)
    for _ in range(12):
        feed.full(runs=settled + 4)
    # Then one probe up of 5 % (the server starved for half a minute), and it stays settled there
    assert [round(m.new / m.old, 2) for m in feed.controller.moves if m.t_s > 300] == [1.05]
    assert feed.controller.settled and feed.controller.kind == "server_takes_all"
    # When it can run 250 from now on (another tenant left): starved again right after the probe
    for _ in range(24):
        feed.full(runs=250)
    # Then the target steers again and the bound is most of the way there within two minutes
    assert feed.controller.bound > 200


def test_a_settled_bound_comes_down_after_ten_minutes_of_headroom_and_not_before() -> None:
    # Given a bound settled on a server that runs 100 of ours
    feed = started(slots=512)
    for _ in range(60):
        feed.full(runs=100)
    assert feed.controller.settled
    settled, moves = feed.controller.bound, len(feed.controller.moves)
    # When it runs 80 from now on (a 20 % drop: not the lasting shift of 35 % that acts at once)
    for _ in range(110):  # nine minutes
        feed.full(runs=80)
    # Then the bound waits for ten minutes of evidence…
    assert feed.controller.bound == settled and len(feed.controller.moves) == moves
    for _ in range(24):
        feed.full(runs=80)
    # …then comes down to the most it ran over that window plus a short queue, once
    assert 80 < feed.controller.bound <= 80 + 8
    assert len(feed.controller.moves) == moves + 1 and feed.controller.moves[-1].reason.startswith("settled:")


def test_a_lasting_halving_of_what_the_server_runs_moves_the_bound_within_a_minute() -> None:
    # Given a steady server running 120 of ours
    feed = started(slots=512)
    for _ in range(120):
        feed.full(runs=120)
    steady = feed.controller.bound
    # When another tenant takes half of it
    for _ in range(12):  # one minute
        feed.full(runs=60)
    # Then the bound has come most of the way down to 60 plus a short queue
    assert feed.controller.bound < steady - 0.6 * (steady - 60)


# -- wire --------------------------------------------------------------------------------------------------
def test_load_and_retractions_are_read_from_0_5_9s_endpoints() -> None:
    v1 = {
        "loads": [
            {"num_running_reqs": 7, "num_waiting_reqs": 2, "num_used_tokens": 900, "max_total_num_tokens": 10_000}
        ]
    }
    assert parse_load(v1) == (7, 2, 900, 10_000)
    legacy = [{"rid": None, "dp_rank": None, "num_reqs": 9, "num_waiting_reqs": 2, "num_tokens": 1234, "ts_tic": 1.0}]
    assert parse_load(legacy) == (7, 2, None, None)
    assert parse_load({"detail": "Not Found"}) is None
    text = 'sglang:num_retracted_requests_total{model_name="m"} 12.0\nsglang:num_retracted_reqs{model_name="m"} 1.0\n'
    assert parse_retractions(text) == 12
    assert parse_retractions("sglang:num_running_reqs 3\n") is None


def test_without_a_metrics_counter_the_retractions_our_answers_report_are_used() -> None:
    # Given a server that answers /v1/loads but has no /metrics (no --enable-metrics)
    async def get_json(path: str) -> object:
        assert path == "/v1/loads"
        return {
            "loads": [{"num_running_reqs": 5, "num_waiting_reqs": 1, "num_used_tokens": 10, "max_total_num_tokens": 99}]
        }

    async def get_text(path: str) -> str:
        raise NotServed(path)

    watcher = LoadWatcher(
        InflightController(10),
        ResizableLimiter(10),
        get_json,
        get_text,
        lambda: 6,
        lambda: 1.0,
        row_retractions=lambda: 7,
    )
    sample = asyncio.run(watcher.read())
    # Then the sample carries the server's load and the retractions counted from our answers' meta_info
    assert sample == LoadSample(1.0, 6, 5, 1, 10, 99, 7)


def test_a_metrics_page_without_the_counter_yet_reads_as_none_retracted_until_our_answers_say_otherwise() -> None:
    # Given a 0.5.9 that has not retracted yet: /metrics declares the counter but has no sample of it (a labelled
    # Prometheus counter gets one at its first increment), and then shows one
    pages = ["# TYPE sglang:num_retracted_requests_total counter\n", 'sglang:num_retracted_requests_total{m="x"} 9\n']
    rows = {"n": 0}

    async def get_json(path: str) -> object:
        return {
            "loads": [{"num_running_reqs": 5, "num_waiting_reqs": 0, "num_used_tokens": 1, "max_total_num_tokens": 9}]
        }

    async def get_text(path: str) -> str:
        return pages[0] if len(pages) == 1 else pages.pop(0)

    def watcher() -> LoadWatcher:
        return LoadWatcher(
            InflightController(10), ResizableLimiter(10), get_json, get_text, lambda: 5, lambda: 1.0,
            row_retractions=lambda: rows["n"],
        )  # fmt: skip

    w = watcher()
    # Then it reads as 0 retracted (the server's counter stays the source), and the sample once it appears
    assert [asyncio.run(w.read()).retractions_total for _ in range(3)] == [0, 9, 9]  # type: ignore[union-attr]
    # But a server whose /metrics never shows it while our answers report retractions does not export it:
    # our answers' count is the source from then on
    pages[:] = ["sglang:num_running_reqs 3\n"]
    w = watcher()
    assert asyncio.run(w.read()).retractions_total == 0  # type: ignore[union-attr]
    rows["n"] = 4
    assert [asyncio.run(w.read()).retractions_total for _ in range(2)] == [4, 4]  # type: ignore[union-attr]


def test_a_v1_loads_that_keeps_failing_is_read_from_get_load_with_the_kv_from_metrics() -> None:
    # Given a real 0.5.9 as the tier runs it: /v1/loads answers 500 every time (--enable-metrics under a newer
    # FastAPI), /get_load answers, and /metrics has the KV gauges but no retraction counter yet
    calls: list[str] = []

    async def get_json(path: str) -> object:
        calls.append(path)
        if path == "/v1/loads":
            raise ServerError(path, 500)
        return [{"rid": None, "dp_rank": None, "num_reqs": 9, "num_waiting_reqs": 2, "num_tokens": 5000, "ts_tic": 1}]

    async def get_text(path: str) -> str:
        return 'sglang:num_used_tokens{tp_rank="0"} 4000.0\nsglang:max_total_num_tokens{tp_rank="0"} 65536.0\n'

    watcher = LoadWatcher(InflightController(10), ResizableLimiter(10), get_json, get_text, lambda: 9, lambda: 1.0)
    samples = [asyncio.run(watcher.read()) for _ in range(5)]
    # Then every read has the load (7 running, 2 waiting) and the KV from /metrics, none retracted so far
    assert set(samples) == {LoadSample(1.0, 9, 7, 2, 4000, 65536, 0)}
    # …and after three failures in a row /v1/loads is no longer asked
    assert calls == ["/v1/loads", "/get_load"] * 3 + ["/get_load"] * 2


def test_a_failed_read_neither_switches_endpoints_nor_mixes_retraction_counters() -> None:
    # Given a server whose /v1/loads and /metrics fail once (restarting, say), then answer
    calls: list[str] = []
    fail = {"/v1/loads": 1, "/metrics": 1}

    async def get_json(path: str) -> object:
        calls.append(path)
        if fail.get(path):
            fail[path] -= 1
            raise RuntimeError(f"GET {path} -> 503")
        return {
            "loads": [{"num_running_reqs": 5, "num_waiting_reqs": 0, "num_used_tokens": 1, "max_total_num_tokens": 9}]
        }

    async def get_text(path: str) -> str:
        if fail.get(path):
            fail[path] -= 1
            raise RuntimeError(f"GET {path} -> 503")
        return "sglang:num_retracted_requests_total 40.0\n"

    watcher = LoadWatcher(
        InflightController(10),
        ResizableLimiter(10),
        get_json,
        get_text,
        lambda: 5,
        lambda: 1.0,
        row_retractions=lambda: 2,
    )
    with pytest.raises(RuntimeError):
        asyncio.run(watcher.read())  # the failed load read is skipped by the watcher's loop
    first = asyncio.run(watcher.read())
    second = asyncio.run(watcher.read())
    # Then /v1/loads is still the endpoint, and the counter is the server's or none, never our answers'
    assert calls == ["/v1/loads"] * 3
    assert first is not None and first.retractions_total is None
    assert second is not None and second.retractions_total == 40


# -- the limiter -------------------------------------------------------------------------------------------
def test_the_limiter_holds_the_bound_and_follows_a_resize_as_holders_release() -> None:
    async def scenario() -> list[int]:
        limiter = ResizableLimiter(2)
        held: list[int] = []
        await limiter.acquire()
        await limiter.acquire()
        third = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        held.append(limiter.held)  # 2: the third waits
        limiter.resize(3)
        await asyncio.sleep(0)
        held.append(limiter.held)  # 3: the raise let it in
        assert third.done()
        limiter.resize(1)  # lowered: nobody is cancelled, newcomers wait until the holders go below it
        fourth = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        for _ in range(2):
            limiter.release()
        await asyncio.sleep(0)
        held.append(limiter.held)  # 1: still over the new limit, the fourth waits
        assert not fourth.done()
        limiter.release()
        await asyncio.sleep(0)
        held.append(limiter.held)  # 1: the fourth got in
        assert fourth.done()
        cancelled = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        limiter.release()
        await asyncio.sleep(0)
        held.append(limiter.held)  # 0: a cancelled waiter takes no slot
        return held

    assert asyncio.run(scenario()) == [2, 3, 1, 1, 0]


# -- a real worker -----------------------------------------------------------------------------------------
def _sim(port: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_sim.cli", "--port", str(port), "--time-scale", "400", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    wait_for_port(port, 30)
    return proc


def test_an_auto_worker_bounds_itself_by_the_server_and_starts_again_after_its_restart(
    redis_url: str, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    port = free_port()
    sim_url = f"http://127.0.0.1:{port}"
    sim = _sim(port, tmp_path / "sim.log", "--max-running-requests", "12")
    env = fast_env(settings, sim_url, max_inflight=40, inflight_mode="auto", inflight_interval_s=0.5)
    worker = WorkerProcess("auto", env, tmp_path).start()

    def info() -> dict[str, object]:
        raw = client.hget(settings.keys.workers, worker.name)
        return json.loads(raw) if raw else {}

    try:
        worker.wait_ready(client, settings.keys)
        job = submit_ids(settings, "auto", make_prompts(600))  # a queue that outlasts the first checks
        # Given a server with 12 slots: the bound is what it runs plus a short queue, under the cap of 40
        wait_until(lambda: info().get("inflight_mode") == "auto" and 12 <= int(info()["inflight_bound"]) <= 16, 60)
        assert info()["inflight_reason"]
        # And Celery's prefetch follows the bound, not the cap: while prompts still wait in the queue, the worker
        # holds no more than the bound plus the commit headroom (the cap's prefetch is 40 + 10)
        metrics_port = int(info()["metrics_port"])
        worker_settings = settings.with_overrides(max_inflight=40)  # the worker's cap: its commit headroom is 10

        bounds_seen: list[int] = []

        def held_and_prefetch() -> tuple[float, int]:
            # The bound is re-decided every 0.5 s and the worker drains to a lower one rather than handing messages
            # back: held is compared with the prefetch of the highest bound seen so far, not the one of this instant
            # (a loaded box sampled a drain in progress).
            bounds_seen.append(int(info()["inflight_bound"]))
            text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
            lines = [line for line in text.splitlines() if line.startswith("thinkfleet_held_messages ")]
            prefetch = prefetch_for(max(bounds_seen), worker_settings)
            return (float(lines[0].split()[1]) if lines else -1.0), prefetch

        # (the messages reserved before the first decision drain first)
        wait_until(lambda: 0 < (hp := held_and_prefetch())[0] <= hp[1], 60, what="held down to the bound's prefetch")
        samples = []
        while client.llen(settings.queue) > 0 and len(samples) < 20:
            samples.append(held_and_prefetch())
            time.sleep(0.1)
        assert len(samples) >= 3, "the queue ran dry before the prefetch could be watched"
        assert all(held <= prefetch for held, prefetch in samples), samples  # without it: up to 39 of 50 held
        assert prefetch_for(max(bounds_seen), worker_settings) < prefetch_for(40, worker_settings), bounds_seen
        # And producer status shows it per worker (producer/bounds.py reads what the heartbeat publishes)
        shown = inflight_bounds(client, settings)[worker.name]
        assert shown["mode"] == "auto" and shown["cap"] == 40 and shown["reason"]
        status = producer_cli(settings, "status", "auto", in_process=True)
        assert status.returncode == 0 and "in-flight bound per worker" in status.stdout, status.stdout + status.stderr
        # When the server restarts with 3 slots, and the worker sees it gone (a probe, or a request in flight failing)
        # before the new one answers: at time-scale 400 the job can be done by now, and a restart quicker than a
        # probe, with nothing in flight, is one no worker can tell from no restart
        closed = worker.gate_closures()
        sim.kill()
        sim.wait(10)
        wait_until(lambda: worker.gate_closures() > closed, 60, what="the worker's gate closed on the dead server")
        sim = _sim(port, tmp_path / "sim.log", "--max-running-requests", "3")
        # Then the bound starts again from the new limits, and the job still completes
        wait_until(lambda: int(info().get("inflight_bound", 99)) <= 3 + 4, 60, what="bound from the new limits")
        wait_until(lambda: job_progress(client, settings.keys, "auto")["done"] == len(job.prompts), 120)
    finally:
        worker.terminate()
        sim.kill()
        sim.wait(10)
