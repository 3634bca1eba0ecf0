"""Operator commands racing live, dead and paused workers (issue 32, scenarios 4 and 6): real ``worker`` processes, a
real Redis, the simulator over HTTP, real Parquet; every wait is on a condition, every race held open by a failpoint
(kill or stop) or a paused job.

- ``producer cancel`` while a SIGKILLed worker's claims are parked: every prompt ends dead-lettered ``cancelled``
  (cancel's count is the dead letters), and ``resume`` + ``retry --error-class cancelled`` stores them all.
- a revision-0 run held paused (failpoint ``after_mark=stop``) across ``producer retry --truncated``: when it
  resumes, its late row is fenced (revision), and the revision-1 message is generated and stored: the committed
  row is revision 1, ``wait`` and ``verify`` agree; and the orphan recovery never finalizes an older revision's
  committed part row for a newer revision's message.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pyarrow.parquet as pq
import redis

from sglang_sim.testing import SimulatorProcess
from storage import reader
from storage.schema import PROMPT_ID, REVISION
from testing.fleet import WorkerProcess, dead_letters, in_flight, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from testing.record import check_job, record_result
from thinkfleet import failpoints
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.settings import Settings

#: Short enough that a killed or paused worker's claims and deliveries are another's within seconds.
LEASE = {"lease_s": 4, "reaper_interval_s": 0.5}


def _fast_sim(tmp_path: Path) -> SimulatorProcess:
    sim = SimulatorProcess("--time-scale", "400")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    return sim


def _nothing_delivered(client: redis.Redis, settings: Settings) -> bool:
    """No message is delivered or popped (kombu's unacked hash and every transit list are empty)."""
    unacked = str(kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"])
    transit = any(client.llen(k) for k in client.scan_iter(match=settings.keys.transit("") + "*"))
    return not client.hlen(unacked) and not transit


def _params(client: redis.Redis, settings: Settings, job: str) -> dict[str, object]:
    return json.loads(client.hget(settings.keys.job(job), "sampling_params"))


def test_cancel_with_a_killed_workers_claims_parked_dead_letters_every_prompt_and_retry_revives_them(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a job of 12 prompts whose only worker is SIGKILLed right after a claim (failpoint after_claim=kill),
    # holding claims; the job is paused, and the dead worker's deliveries come back to another worker, which parks
    # them: the dead worker's claims stay on parked prompts.
    n = 12
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    armed = {failpoints.ENV: "after_claim=kill", failpoints.DIR_ENV: str(fp_dir), failpoints.TIMES_ENV: "1"}
    sim = _fast_sim(tmp_path)
    env = fast_env(settings, sim.url, max_inflight=4, **LEASE)
    victim = WorkerProcess("victim", {**env, **armed}, tmp_path).start()
    other = WorkerProcess("other", env, tmp_path)
    started = time.monotonic()
    try:
        victim.wait_ready(client, keys)
        job = submit_ids(settings, "cx", make_prompts(n, seed=21), max_new_tokens=64)
        wait_until(lambda: not victim.alive(), 120, 0.05, what="the victim killed at after_claim")
        assert producer_cli(settings, "pause", "cx", in_process=True).returncode == 0
        held = in_flight(client, keys, "cx", "victim")
        assert held, "the dead worker holds claims"
        other.start().wait_ready(client, keys)
        wait_until(lambda: not client.exists(keys.heartbeat("victim")), 60, what="the victim's heartbeat gone")
        # Every message parked (the victim's restored deliveries too): one restored onto the queue but not yet taken
        # would be taken by `other` after the cancel and dead-lettered by it, not counted by cancel.
        wait_until(
            lambda: _nothing_delivered(client, settings) and client.llen(keys.parked("cx")) >= n,
            120,
            what="the victim's deliveries parked",
        )
        assert in_flight(client, keys, "cx", "victim") == held, "the dead worker's claims are still there"
        assert job_progress(client, keys, "cx")["done"] == 0
        # When the job is cancelled.
        out = producer_cli(settings, "cancel", "cx", in_process=True)
        assert out.returncode == 0, out.stderr
        reported = int(re.search(r"cancelled: (\d+) queued", out.stdout).group(1))
        # Then every prompt is dead-lettered `cancelled`, and the count cancel reported is the dead letters.
        dead = dead_letters(client, keys, "cx")
        assert set(dead) == set(job.prompts), f"neither stored nor dead: {sorted(set(job.prompts) - set(dead))}"
        assert {d["error_class"] for d in dead.values()} == {"cancelled"}
        assert reported == len(dead) == n
        assert not client.llen(keys.parked("cx"))
        # And resume + retry --error-class cancelled revives every one of them.
        assert producer_cli(settings, "resume", "cx", in_process=True).returncode == 0
        retry = producer_cli(settings, "retry", "cx", "--error-class", "cancelled", in_process=True)
        assert retry.returncode == 0, retry.stderr
        wait_until(lambda: job_progress(client, keys, "cx")["done"] == n, 180, what="every prompt stored")
        waited = producer_cli(settings, "wait", "cx", "--timeout", "60", in_process=True)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    finally:
        victim.kill()
        other.terminate()
        sim.kill()
    outcome = check_job(settings, "cx", job.prompts, _params(client, settings, "cx"))
    record_result(
        "producer cancel with a SIGKILLed worker's claims parked, then resume + retry --error-class cancelled",
        outcome,
        f"{n} prompts paused, {len(held)} claimed by a worker SIGKILLed after its claims; cancel: {reported} "
        "dead-lettered = the dead letters; all revived",
        [],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()


def test_a_revision_0_run_paused_across_a_truncated_retry_is_fenced_and_revision_1_is_stored(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a worker that stops itself (SIGSTOP) right after mark_part, holding revision-0 rows of 3 prompts whose
    # budget of 8 tokens truncates them; another worker takes them over after its lease and stores them.
    n = 3
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    armed = {failpoints.ENV: "after_mark=stop", failpoints.DIR_ENV: str(fp_dir), failpoints.TIMES_ENV: "1"}
    sim = _fast_sim(tmp_path)
    env = fast_env(settings, sim.url, max_inflight=4, **LEASE)
    zombie = WorkerProcess("zombie", {**env, **armed}, tmp_path).start()
    other = WorkerProcess("other", env, tmp_path)
    second = WorkerProcess("second", env, tmp_path)
    started = time.monotonic()
    try:
        zombie.wait_ready(client, keys)
        job = submit_ids(settings, "rv", make_prompts(n, seed=22), max_new_tokens=8)
        wait_until(lambda: zombie.stopped(), 120, 0.05, what="the zombie stopped at after_mark")
        held = in_flight(client, keys, "rv", "zombie")
        assert held, "the zombie holds the rows it stopped on"
        other.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, "rv")["done"] == n, 180, what="revision 0 stored")
        other.terminate()
        # When the operator pauses the job (so that no revision-1 message runs before the zombie is back) and
        # re-runs the truncated rows as revision 1 with a larger budget.
        assert producer_cli(settings, "pause", "rv", in_process=True).returncode == 0
        retry = producer_cli(
            settings, "retry", "rv", "--truncated", "--max-new-tokens", "64", "--json", in_process=True
        )
        assert retry.returncode == 0, retry.stderr
        rerun = set(json.loads(retry.stdout)["prompt_ids"])
        assert rerun & held, "a prompt the zombie holds is re-run"
        # And the zombie resumes: its revision-0 part lands, and its rows come to their outcome.
        zombie.cont()

        def zombie_settled() -> bool:
            fenced = int(client.hget(keys.counters("rv"), "fenced") or 0)
            done = {m.decode() for m in client.smembers(keys.done("rv"))}
            return fenced + len(held & rerun & done) >= len(held)

        wait_until(zombie_settled, 120, what="the zombie's late rows fenced or finalized")
        # Then a second worker (and the zombie) run the revision-1 messages once the job is resumed.
        assert producer_cli(settings, "resume", "rv", in_process=True).returncode == 0
        second.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, "rv")["done"] == n, 180, what="revision 1 stored")
        waited = producer_cli(settings, "wait", "rv", "--timeout", "60", in_process=True)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    finally:
        zombie.cont()
        zombie.kill()
        other.kill()
        second.terminate()
        sim.kill()
    # Then the committed row of every re-run prompt is revision 1 (none was acked `already-done` on the zombie's
    # revision-0 row), the zombie's refusal was counted as fenced and logged, never as a traceback.
    winners = reader.read_committed(settings.output_uri, "rv", columns=[PROMPT_ID, REVISION])
    revisions = dict(zip(winners[PROMPT_ID].to_pylist(), winners[REVISION].to_pylist(), strict=True))
    assert {pid: revisions[pid] for pid in rerun} == dict.fromkeys(rerun, 1)
    zombie_log = zombie.log_path.read_text(errors="replace")
    assert "revision 1" in zombie_log and "Traceback" not in zombie_log
    overrides = {pid: {"max_new_tokens": 64} for pid in rerun}
    outcome = check_job(settings, "rv", job.prompts, job.sampling_params, overrides=overrides)
    record_result(
        "revision-0 run paused (after_mark=stop) across producer retry --truncated, then SIGCONT",
        outcome,
        f"{n} prompts, {len(rerun)} re-run as revision 1 while the zombie held {len(held)}; its late rows fenced",
        [],
        time.monotonic() - started,
        workers=3,
    )
    outcome.assert_clean()


def test_an_older_revisions_committed_part_is_not_finalized_for_the_requested_revision(
    redis_url: str, tmp_path: Path
) -> None:
    # Given 2 prompts stored at revision 0 (truncated at 8 tokens), re-run by producer retry --truncated as
    # revision 1 while no worker runs, and a dead run's claim on one of them naming the committed revision-0 part
    # (a run that wrote its part and died before its finalize: the orphan recovery's case).
    n = 2
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    sim = _fast_sim(tmp_path)
    env = fast_env(settings, sim.url, max_inflight=4, **LEASE)
    first = WorkerProcess("first", env, tmp_path).start()
    second = WorkerProcess("second", env, tmp_path)
    started = time.monotonic()
    try:
        first.wait_ready(client, keys)
        job = submit_ids(settings, "orv", make_prompts(n, seed=23), max_new_tokens=8)
        wait_until(lambda: job_progress(client, keys, "orv")["done"] == n, 120, what="revision 0 stored")
        first.terminate()
        retry = producer_cli(
            settings, "retry", "orv", "--truncated", "--max-new-tokens", "64", "--json", in_process=True
        )
        assert retry.returncode == 0, retry.stderr
        rerun = set(json.loads(retry.stdout)["prompt_ids"])
        assert rerun, "outputs were cut at 8 tokens"
        pid = sorted(rerun)[0]
        part = next(
            str(p)
            for p in sorted((tmp_path / "out").rglob("part-*.parquet"))
            if pid in pq.read_table(p, columns=[PROMPT_ID])[PROMPT_ID].to_pylist()
        )
        dead_run = {"worker": "", "part": part, "settled": True, "at": time.time(), "epoch": "1"}
        client.hset(keys.claims("orv"), pid, json.dumps(dead_run))
        # When a worker takes the revision-1 messages.
        second.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, "orv")["done"] == n, 120, what="revision 1 stored")
        waited = producer_cli(settings, "wait", "orv", "--timeout", "60", in_process=True)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    finally:
        first.kill()
        second.terminate()
        sim.kill()
    # Then the prompt is generated at revision 1 — its revision-0 row is not finalized for it — and stored once.
    winners = reader.read_committed(settings.output_uri, "orv", columns=[PROMPT_ID, REVISION])
    revisions = dict(zip(winners[PROMPT_ID].to_pylist(), winners[REVISION].to_pylist(), strict=True))
    assert {p: revisions[p] for p in rerun} == dict.fromkeys(rerun, 1)
    assert "holds revision 0" in second.log_path.read_text(errors="replace")
    overrides = {p: {"max_new_tokens": 64} for p in rerun}
    outcome = check_job(settings, "orv", job.prompts, job.sampling_params, overrides=overrides)
    record_result(
        "orphan recovery of an older revision's committed part after producer retry --truncated",
        outcome,
        f"{n} prompts, {len(rerun)} re-run as revision 1; a dead run's claim names {pid}'s revision-0 part",
        [],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
