"""Reliability when workers die: SIGKILL (a host vanishing) and SIGTERM (a spot preemption).

Given a real redis-server, real `worker` (celery) subprocesses and the simulator over loopback,
when workers are killed or preempted mid-job, then every prompt is stored exactly once, byte-exact,
`producer verify` passes and `producer status` agrees with storage.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import redis
import redis.asyncio as aioredis

from testing.fleet import RecoveryWatch, WorkerProcess, in_flight, job_progress, wait_until
from testing.harness import (
    fast_env,
    isolated_settings,
    make_prompts,
    register_ids,
    simulator,
    submit_ids,
    transit_prompt_ids,
)
from testing.invariant_watch import InvariantWatch
from testing.record import check_job, record_result
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.settings import Settings
from thinkfleet.state.invariant import queued_prompt_ids
from thinkfleet.state.ledger import Ledger
from workers.runtime import WorkerRuntime


def test_worker_killed_three_times_loses_and_duplicates_nothing(redis_url: str, tmp_path: Path) -> None:
    # Given two workers on one simulator, one of which will be SIGKILLed three times and restarted.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    started = time.monotonic()
    watches: list[RecoveryWatch] = []
    invariant = InvariantWatch(settings, "kill3")
    with simulator(tmp_path, "--time-scale", "20") as sim:
        env = fast_env(settings, sim, max_inflight=4)
        victim = WorkerProcess("victim", env, tmp_path).start()
        survivor = WorkerProcess("survivor", env, tmp_path).start()
        try:
            victim.wait_ready(client, keys)
            survivor.wait_ready(client, keys)
            # 150 prompts: after the third kill there is still work for the restarted victim to be busy with,
            # however slowly it restarts on a loaded box (with 90, the survivor could finish the job first).
            job = submit_ids(settings, "kill3", make_prompts(150))
            invariant.start()  # every prompt stays somewhere while workers die
            # When the victim is killed with work in flight, three times, and restarted each time.
            for threshold in (10, 35, 60):
                wait_until(lambda t=threshold: job_progress(client, keys, "kill3")["done"] >= t, 120, what="progress")
                # (a generous bound: a victim just restarted on a box at load 20 took over 60 s to hold work)
                wait_until(lambda: in_flight(client, keys, "kill3", "victim"), 240, what="the victim busy")
                watches.append(RecoveryWatch(redis_url, keys, "kill3", "sigkill").start())
                victim.kill()
                victim.start().wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, "kill3")["done"] == 150, 240, what="150 rows")
        finally:
            invariant.stop()
            victim.kill()
            survivor.terminate()
    # Then nothing is lost, duplicated or altered.
    outcome = check_job(settings, "kill3", job.prompts, job.sampling_params)
    record_result(
        "worker SIGKILL ×3 (restarted each time)",
        outcome,
        "3 × SIGKILL of 1 of 2 workers",
        [w.stop() for w in watches],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
    invariant.assert_held()
    assert victim.starts == 4


def test_preempted_worker_hands_its_work_back_without_waiting_for_the_lease(redis_url: str, tmp_path: Path) -> None:
    # Given one worker whose lease is far longer than the test, busy with slow generations.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    unacked = str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "8") as sim:
        env = fast_env(settings, sim, max_inflight=6, lease_s=600, shutdown_grace_s=0.5)
        worker = WorkerProcess("spot", env, tmp_path).start()
        try:
            worker.wait_ready(client, keys)
            job = submit_ids(settings, "preempt", make_prompts(24), max_new_tokens=512)
            wait_until(lambda: len(in_flight(client, keys, "preempt")) >= 3, 60, what="requests in flight")
            held = in_flight(client, keys, "preempt")
            # When it is preempted (SIGTERM) mid-generation.
            watch = RecoveryWatch(redis_url, keys, "preempt", "sigterm").start()
            worker.terminate()
            # Then its in-flight prompts are back on the queue at once: no claim, no unacked message left
            # to wait out a 600 s lease.
            done = {m.decode() for m in client.smembers(keys.done("preempt"))}
            assert client.hlen(unacked) == 0, "a preempted worker leaves nothing to the visibility timeout"
            assert not in_flight(client, keys, "preempt"), "its claims are released"
            waiting = queued_prompt_ids(client, settings, "preempt") | transit_prompt_ids(client, settings, "preempt")
            assert held - done <= waiting
            assert waiting == set(job.prompts) - done
            # And a restarted worker finishes the job.
            worker.start().wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, "preempt")["done"] == 24, 120, what="24 rows")
        finally:
            worker.terminate()
    outcome = check_job(settings, "preempt", job.prompts, job.sampling_params)
    record_result(
        "worker SIGTERM (preemption), then restart",
        outcome,
        "SIGTERM mid-generation; lease 600 s",
        [watch.stop()],
        time.monotonic() - started,
    )
    outcome.assert_clean()


def _blocked_in_pop(client: redis.Redis) -> bool:
    return any(c.get("cmd") in ("brpop", "blmove") and "b" in c.get("flags", "") for c in client.client_list())


def test_message_popped_by_a_worker_killed_before_kombu_records_it_is_not_lost(redis_url: str, tmp_path: Path) -> None:
    # Given an idle worker frozen (SIGSTOP) while its blocking pop waits in Redis, and a second worker.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "400") as sim:
        env = fast_env(settings, sim, max_inflight=2)
        frozen = WorkerProcess("frozen", env, tmp_path).start()
        other = WorkerProcess("other", env, tmp_path).start()
        try:
            frozen.wait_ready(client, keys)
            other.wait_ready(client, keys)
            other.proc.send_signal(signal.SIGSTOP)  # keep it out of the race for the message…
            time.sleep(1.5)  # …once its pending pop (1 s timeout) has expired in Redis
            job, tasks = register_ids(settings, "gap", make_prompts(1))
            message = Envelope(settings).encode(tasks[0])
            assert frozen.proc is not None
            for _ in range(100):
                os.kill(frozen.proc.pid, signal.SIGSTOP)
                if _blocked_in_pop(client):
                    break
                os.kill(frozen.proc.pid, signal.SIGCONT)
                time.sleep(0.05)
            else:
                raise AssertionError("the worker never blocked in its pop")
            # When a message arrives, Redis hands it to the frozen worker's pop, and the worker dies
            # before kombu could record it as unacked.
            client.lpush(settings.queue, message)
            wait_until(lambda: client.llen(settings.queue) == 0, 10, what="the message popped")
            watch = RecoveryWatch(redis_url, keys, "gap", "pop-gap").start(set(job.prompts))
            frozen.kill()
            other.proc.send_signal(signal.SIGCONT)
            # Then the surviving worker returns it from the dead worker's transit list and stores it.
            wait_until(lambda: job_progress(client, keys, "gap")["done"] == 1, 60, what="the prompt stored")
        finally:
            frozen.kill()
            if other.proc is not None and other.alive():
                other.proc.send_signal(signal.SIGCONT)
            other.terminate()
    outcome = check_job(settings, "gap", job.prompts, job.sampling_params)
    record_result(
        "worker SIGKILL between kombu's pop and its unacked record",
        outcome,
        "SIGSTOP in BRPOP/BLMOVE, message popped, SIGKILL",
        [watch.stop()],
        time.monotonic() - started,
        workers=2,
        notes="lost with kombu's stock BRPOP; thinkfleet/broker/transit.py keeps it in Redis",
    )
    outcome.assert_clean()


def test_a_worker_restarted_under_its_name_gives_up_its_dead_runs_claims(redis_url: str) -> None:
    # Given a prompt claimed by worker "w", which dies and restarts under the same name (fresh heartbeat).
    settings = isolated_settings(redis_url, "unused")
    keys = settings.keys

    async def scenario() -> tuple[str, str, int]:
        r = aioredis.from_url(redis_url)
        await r.sadd(keys.jobs, "j")
        await Ledger(r, keys, "w").claim("j", "p1")
        await r.set(keys.heartbeat("w"), "{}")
        before = (await Ledger(r, keys, "other").claim("j", "p1")).state
        # When its new run starts.
        abandoned = await Ledger(r, keys, "w").abandon_claims()
        # Then another worker's redelivered copy takes the prompt over instead of waiting forever.
        after = (await Ledger(r, keys, "other").claim("j", "p1")).state
        await r.aclose()
        return before, after, abandoned

    assert asyncio.run(scenario()) == ("busy", "stale", 1)


def test_a_worker_whose_server_turns_healthy_while_it_attaches_keeps_consuming() -> None:
    # Given a worker runtime attaching to Celery's consumer just as its health gate turns healthy, and a
    # consumer loop that, like kombu's hub, runs pending callbacks in no particular order.
    class TaskConsumer:
        def __init__(self) -> None:
            self.active = {"q"}

        def consuming_from(self, queue: str) -> bool:
            return queue in self.active

    class Consumer:
        def __init__(self) -> None:
            self.task_consumer = TaskConsumer()
            self.pending: list = []

        def add_task_queue(self, queue: str) -> None:
            self.task_consumer.active.add(queue)

        def cancel_task_queue(self, queue: str) -> None:
            self.task_consumer.active.discard(queue)

        def call_soon(self, fn) -> None:
            self.pending.append(fn)

    for order in ("forward", "reverse"):
        rt = WorkerRuntime.__new__(WorkerRuntime)
        rt.settings = Settings(queue="q")
        rt.consumer, rt.draining, rt.storage_ok = None, False, True
        rt.metrics = SimpleNamespace(healthy=SimpleNamespace(set=lambda value: None))
        rt.gate = SimpleNamespace(healthy=False)
        consumer = Consumer()
        # When the consumer attaches before the first probe (not healthy yet: a cancel is wanted)…
        rt.attach_consumer(consumer)
        # …and the gate turns healthy right after, from its own thread.
        rt.gate.healthy = True
        flip = threading.Thread(target=rt._server_up)
        flip.start()
        flip.join(5)
        steps = consumer.pending if order == "forward" else consumer.pending[::-1]
        for step in steps:
            step()
        # Then whatever order the loop ran them in, a healthy worker ends up consuming.
        assert consumer.task_consumer.consuming_from("q"), order
