"""Host affinity end to end (thinkfleet/broker/affinity.py): real worker processes, one simulator each (its own
prefix cache, as each GPU host has its own radix cache), a ``--turns all`` job submitted with the real CLI.

Given four hosts and conversations of several turns, when the job runs, then (nearly) every turn ≥ 1 runs on the host
that ran its previous turn (the row's ``worker``), every host does its share, and the server found (nearly) all of
each later turn's reusable prefix cached. Given the same fleet with one host SIGKILLed mid-run, then its
conversations move on on the other hosts, and ``producer wait`` exits 0 and ``producer verify`` passes: nothing lost,
nothing stored twice, nothing stranded on the dead host's list.

No assertion reads a clock: the affinity wait is generous where placement is asserted (a stall of the box must not
send a turn elsewhere), fractions keep a margin, and waits poll with long deadlines.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis

from sglang_sim.testing import SimulatorProcess
from storage.reader import read_committed
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, job_progress, stuck_report, wait_for_port, wait_until
from testing.harness import fast_env, isolated_settings, post_json, producer_cli
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import host_glob
from thinkfleet.settings import Settings

HOSTS = 4
TURNS = 3
#: Two requests in flight per host: with the commit headroom (4) a host holds at most 6 messages, so 24
#: conversations fill every host's share of turn 0s — no host idles while another holds extra conversations.
MAX_INFLIGHT = 2
CONVERSATIONS = HOSTS * (MAX_INFLIGHT + 4)
#: A long shared system prompt: a later turn's reusable prefix is hundreds of ids, so the simulator's 16-id cache
#: blocks cost its hit rate little.
SYSTEM = " ".join(["You are a careful assistant who answers precisely and shows its reasoning."] * 12)


def _submit(settings: Settings, tmp_path: Path, job: str) -> None:
    rows = conversation_rows(CONVERSATIONS, TURNS, 12, SYSTEM, reasoning="x")
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    done = producer_cli(
        settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
        "--no-progress", "--max-new-tokens", "200", "--seed", "5", "--context-length", "131072", "--turns", "all",
        "--json", in_process=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _fleet(
    stack: ExitStack,
    settings: Settings,
    tmp_path: Path,
    sims_out: list[SimulatorProcess] | None = None,
    time_scale: int = 300,
    **env: object,
) -> list[WorkerProcess]:
    """HOSTS workers, each driving its own simulator (in ``sims_out`` when given, in the same order); started and
    heartbeating."""
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    client = redis.Redis.from_url(settings.redis_url)
    sims = [SimulatorProcess("--time-scale", str(time_scale)).start(wait=False) for _ in range(HOSTS)]  # all at once
    for sim in sims:
        stack.callback(sim.kill)
    if sims_out is not None:
        sims_out.extend(sims)
    workers = []
    for i, sim in enumerate(sims):
        wait_for_port(sim.port, 30)
        w = WorkerProcess(f"h{i}", fast_env(settings, sim.url, max_inflight=MAX_INFLIGHT, **env), logs).start()
        stack.callback(w.terminate)
        workers.append(w)
    for w in workers:
        w.wait_ready(client, settings.keys)
    return workers


def _turn_rows(settings: Settings, job: str) -> dict[tuple[str, int], dict[str, Any]]:
    columns = ["conversation_id", "turn_index", "worker", "cached_tokens", "prefix_reusable_tokens", "chain_end"]
    table = read_committed(settings.output_uri, job, columns=columns)
    return {(r["conversation_id"], r["turn_index"]): r for r in table.to_pylist()}


def _placement(rows: dict[tuple[str, int], dict[str, Any]]) -> tuple[int, int]:
    """(turns ≥ 1, of them on the host of their previous turn)."""
    later = [(k, r) for k, r in rows.items() if k[1] >= 1]
    same = sum(1 for (conv, t), r in later if rows[(conv, t - 1)]["worker"] == r["worker"])
    return len(later), same


def _json(settings: Settings, *args: str) -> dict[str, Any]:
    done = producer_cli(settings, *args, "--json", in_process=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_later_turns_run_on_the_host_that_has_their_prefix_cached(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job = "affine"
    with ExitStack() as stack:
        # generous waits: a starved CI box must not make a turn wait out its host, nor a host finishing its last
        # conversations take the others' (the idle steal is tests/test_affinity.py's)
        env = {"affinity_wait_s": 60, "affinity_idle_wait_s": 60, "affinity_backlog": 0, "lease_s": 60}
        workers = _fleet(stack, settings, tmp_path, **env)
        _submit(settings, tmp_path, job)
        waited = producer_cli(settings, "wait", job, "--timeout", "240", timeout_s=300)
        assert waited.returncode == 0, waited.stdout + waited.stderr + stuck_report(client, settings, job, workers)
        status = _json(settings, "status", job)

    rows = _turn_rows(settings, job)
    total = len(rows)
    assert total > CONVERSATIONS * (TURNS - 1), "most conversations ran every turn (a few end at a tool call)"
    later, same = _placement(rows)
    assert same >= 0.9 * later, f"only {same}/{later} later turns ran on their previous turn's host"
    per_host = {f"h{i}": sum(1 for r in rows.values() if r["worker"] == f"h{i}") for i in range(HOSTS)}
    assert min(per_host.values()) >= total // (2 * HOSTS), f"every host busy with its share: {per_host}"

    # The reusable prefix of each later turn, and what its server found cached of it.
    reusable = [r["prefix_reusable_tokens"] for (_, t), r in rows.items() if t >= 1]
    assert all(n is not None and n > 0 for n in reusable)
    assert all(r["prefix_reusable_tokens"] is None for (_, t), r in rows.items() if t == 0)
    cached = sum(min(r["cached_tokens"], r["prefix_reusable_tokens"]) for (_, t), r in rows.items() if t >= 1)
    assert cached >= 0.9 * sum(reusable), f"hit rate {cached / sum(reusable):.3f}"
    # producer status reports the same from the job's counters
    prefix = status["prefix_cache"]
    assert prefix["turns"] == later and prefix["reusable_tokens"] == sum(reusable)
    assert prefix["cached_tokens"] == cached and prefix["hit_rate"] >= 0.9
    # … and producer report from storage, with the share of later turns on their previous turn's host
    reported = _json(settings, "report", job)["prefix_cache"]
    assert reported["reusable_tokens"] == sum(reusable) and reported["cached_tokens"] == cached
    assert reported["same_host"] == same and reported["same_host_share"] >= 0.9
    assert not list(client.scan_iter(match=host_glob(settings.queue))), "no message left on a host list"


def _orphaned(rows: dict, worker: str) -> list[tuple[str, int]]:
    """(conversation, turn) whose last stored turn is ``worker``'s, goes on (chain_end "") and has no next turn."""
    return [
        (conv, t)
        for (conv, t), r in rows.items()
        if r["worker"] == worker and r["chain_end"] == "" and (conv, t + 1) not in rows
    ]


def test_a_killed_hosts_conversations_move_on_and_nothing_is_lost(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job = "affine-kill"
    total = CONVERSATIONS * TURNS
    with ExitStack() as stack:
        sims: list[SimulatorProcess] = []
        # (time-scale 60: at 300 a fast box ran the whole job, ~2 s, between two looks of the wait below)
        workers = _fleet(stack, settings, tmp_path, sims, 60, affinity_wait_s=3, lease_s=3, reaper_interval_s=0.5)
        _submit(settings, tmp_path, job)
        # mid-run: once a quarter of the turns are stored, some by it, the last host dies with its conversations' next
        # turns held, in transit or offered on its host list
        doomed = workers[-1]

        at_kill: dict = {}
        stalled: list[bool] = []

        def mid_chain() -> bool:
            """A quarter of the turns stored, and the doomed host's last stored turn of some conversation waiting on
            its next one — looked at with the host frozen (SIGSTOP), so it cannot finish that turn meanwhile; when it
            has none yet, it goes on and is looked at again (on a busy box a fixed moment missed it)."""
            stored_by_doomed = client.hget(settings.keys.worker_counters(job), doomed.name)
            if job_progress(client, settings.keys, job)["done"] < total // 4 or not stored_by_doomed:
                return False
            if not stalled:
                # its server answers nothing from now on: the turns it holds stay unfinished until it dies
                post_json(f"{sims[-1].url}/control/stall", {"seconds": 600})
                stalled.append(True)
            assert doomed.proc is not None
            os.kill(doomed.proc.pid, signal.SIGSTOP)
            rows = _turn_rows(settings, job)
            if _orphaned(rows, doomed.name):
                at_kill.update(rows)
                return True
            doomed.cont()
            return False

        wait_until(mid_chain, 240, interval_s=0.1, what="the doomed host mid-chain")
        doomed.kill()
        waited = producer_cli(settings, "wait", job, "--timeout", "240", timeout_s=300)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        verified = producer_cli(settings, "verify", job, in_process=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr

    rows = _turn_rows(settings, job)
    # The dead host's conversations went on elsewhere: each whose last stored turn at the kill was the dead host's and
    # goes on (chain_end "") has its next turn stored, by a live host.
    orphaned = _orphaned(at_kill, doomed.name)
    assert orphaned, "the killed host held conversations mid-chain"
    for conv, t in orphaned:
        assert rows[(conv, t + 1)]["worker"] != doomed.name
    assert not list(client.scan_iter(match=host_glob(settings.queue))), "nothing stranded on a host list"
