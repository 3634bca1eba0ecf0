"""Host affinity for ``producer retry`` (producer/retry.py, thinkfleet/broker/affinity.py ``offer_resent``), and the
``offered`` count of the finalize (thinkfleet/state/ledger.py).

Given a ``--turns all`` job on two hosts (real worker processes, one simulator each) whose simulators answer some
prompts with bad output, so that some later turns are dead-lettered, when the faults are cleared and the dead letters
retried with the real CLI, then each re-sent turn is offered to — and runs on — the host that stored its
conversation's previous turn, its chain goes on there, and the job ends with every turn stored exactly once
(``producer verify``). Step by step against a real Redis: a re-sent turn is offered with its offer time as a next
turn is, so the same sweep hands it over once it waited too long; a host without a heartbeat, or at its backlog
bound, gets it on the shared queue instead; and a finalize counts each next turn it offers once, however often it is
retried or replayed.

No assertion reads a clock: the affinity wait and the idle steal's wait are generous where placement is asserted.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import requests

from sglang_sim.testing import SimulatorProcess
from storage.reader import read_committed
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_for_port, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, register_ids
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.affinity import AFFINITY, HostAffinity, offer_resent
from thinkfleet.broker.envelope import Envelope
from thinkfleet.broker.keys import host_glob, host_lists
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.state.ledger import FinalRow, Ledger
from thinkfleet.turns import split_step_id

HOSTS, CONVERSATIONS, TURNS = 2, 16, 3
#: Per prompt (by its input ids): every attempt of a chosen prompt is bad, so it is dead-lettered (with this seed,
#: some later turns are).
BAD = ("--bad-output-rate", "0.3", "--fault-seed", "11")
GENEROUS = {"affinity_wait_s": 60, "affinity_idle_wait_s": 60, "affinity_backlog": 0, "lease_s": 60}


def _rows(settings: Any, job: str) -> dict[str, dict[str, Any]]:
    table = read_committed(settings.output_uri, job, columns=["prompt_id", "worker", "revision"])
    return {r["prompt_id"]: r for r in table.to_pylist()}


def _previous(rows: dict[str, dict[str, Any]], pid: str) -> dict[str, Any]:
    conv, turn, step = split_step_id(pid) or ("", 0, 0)
    before = [(split_step_id(p)[1:], r) for p, r in rows.items() if split_step_id(p) and split_step_id(p)[0] == conv]
    return max((at, r) for at, r in before if at < (turn, step))[1]  # type: ignore[type-var]


def test_retried_turns_go_to_the_host_that_ran_their_previous_turn(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job = "affine-retry"
    logs = tmp_path / "logs"
    logs.mkdir()
    with ExitStack() as stack:
        sims = [SimulatorProcess("--time-scale", "400", *BAD).start(wait=False) for _ in range(HOSTS)]
        for sim in sims:
            stack.callback(sim.kill)
        workers = []
        for i, sim in enumerate(sims):
            wait_for_port(sim.port, 30)
            w = WorkerProcess(f"h{i}", fast_env(settings, sim.url, max_inflight=2, **GENEROUS), logs).start()
            stack.callback(w.terminate)
            workers.append(w)
        for w in workers:
            w.wait_ready(client, settings.keys)
        rows_in = conversation_rows(CONVERSATIONS, TURNS, 10, "Answer with care. " * 20, reasoning="x")
        data = write_jsonl(tmp_path / "chat.jsonl", rows_in)
        submitted = producer_cli(
            settings, "submit", str(data), "--job", job, "--tokenizer",
            str(build_test_tokenizer(default_test_tokenizer_dir())), "--processes", "1", "--no-progress",
            "--max-new-tokens", "64", "--seed", "5", "--context-length", "131072", "--turns", "all", "--json",
            in_process=True,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr

        def resolved() -> bool:
            p = job_progress(client, settings.keys, job)
            return p["done"] + p["dead"] == p["submitted"] and p["dead"] > 0

        wait_until(resolved, 240, what="every enqueued turn done or dead")
        dead = dead_letters(client, settings.keys, job)
        later = sorted(p for p in dead if (split_step_id(p) or ("", 0, 0))[1:] > (0, 0))
        assert later, f"the seed dead-letters some later turn: {sorted(dead)}"
        before = _rows(settings, job)
        for sim in sims:  # the hosts' servers are sound again
            requests.post(f"{sim.url}/control/faults", json={"bad_output_rate": 0.0}, timeout=10).raise_for_status()

        retried = producer_cli(settings, "retry", job, "--json", in_process=True)
        assert retried.returncode == 0, retried.stderr
        out = json.loads(retried.stdout)
        assert sorted(out["prompt_ids"]) == sorted(dead)
        want = {p: _previous(before, p)["worker"] for p in later}
        assert out["offered"] == want, "each later turn offered to the host that stored its previous turn"

        def finished() -> bool:
            p = job_progress(client, settings.keys, job)
            return p["dead"] == 0 and p["done"] == p["submitted"]

        wait_until(finished, 240, what="every retried turn and its chain done")
        verified = producer_cli(settings, "verify", job, in_process=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr

    rows = _rows(settings, job)
    assert len(rows) == job_progress(client, settings.keys, job)["done"], "every turn stored exactly once"
    for pid, host in want.items():
        assert rows[pid]["worker"] == host, f"{pid} ran on {rows[pid]['worker']}, offered to {host}"
        conv, turn, _ = split_step_id(pid) or ("", 0, 0)
        for t in range(turn + 1, TURNS):  # its chain went on on the same host (the finalize offers to itself)
            nxt = rows.get(f"{conv}/t{t}")
            if nxt is None:
                break  # the chain ended (a tool call)
            assert nxt["worker"] == host
    assert not list(client.scan_iter(match=host_glob(settings.queue))), "no message left on a host list"


def _message(settings: Any, pid: str, job: str = "resend") -> bytes:
    ids = [1, 2, 3, len(pid)]
    return Envelope(settings).encode(PromptTask(job, "ds", pid, 0, content_hash(ids), pack_ids(ids)))


def test_a_resent_turn_is_offered_as_a_next_turn_is_and_handed_over_by_the_same_rules(
    redis_url: str, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"), affinity_wait_s=5.0, affinity_backlog=2)
    client = redis.Redis.from_url(redis_url)
    offers = settings.keys.affinity_offers(settings.queue)
    client.set(settings.keys.heartbeat("alive"), "1")
    m = [_message(settings, f"c{k}/t1") for k in range(4)]
    with client.pipeline(transaction=True) as pipe:
        offer_resent(pipe, settings, "alive", 0, m[:3])  # room for 2 (the backlog bound): the third is shared
        offer_resent(pipe, settings, "gone", 0, m[3:])  # no heartbeat: shared at once
        replies = pipe.execute()
    assert replies == [2, 0]
    assert client.lrange(host_lists(settings.queue, "alive")[0], 0, -1) == [m[1], m[0]], "first in, first out"
    assert client.lrange(settings.queue, 0, -1) == [m[3], m[2]]
    assert [x.split(b"\n")[0] for x in client.zrange(offers, 0, -1)] == [b"alive", b"alive"]
    # Offered with Redis's time: once older than the wait, any live worker's sweep hands them to the shared queue.
    client.zadd(offers, {member: 1.0 for member in client.zrange(offers, 0, -1)})

    async def sweep() -> tuple[int, int]:
        aclient = aioredis.from_url(redis_url)
        try:
            return await HostAffinity(aclient, settings, "other").sweep()
        finally:
            await aclient.aclose()

    assert asyncio.run(sweep()) == (2, 0)
    assert client.lrange(settings.queue, 0, -1) == [m[3], m[2], m[0], m[1]], "onto the consuming end, oldest first"
    assert not client.zcard(offers) and not client.exists(*host_lists(settings.queue, "alive"))


def test_a_finalize_counts_each_offered_next_turn_once_however_often_it_is_retried(
    redis_url: str, tmp_path: Path
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys, job = settings.keys, "counted"
    register_ids(settings, job, {"c/t0": [1, 2, 3], "d/t0": [4, 5, 6]}, dataset="ds")
    host = host_lists(settings.queue, "w1")[0]
    offers = keys.affinity_offers(settings.queue)

    class Next:
        def __init__(self, pid: str, nxt: str) -> None:
            self.prompt_id, self.answer, self.next_prompt_id = pid, json.dumps({"content": "a"}), nxt
            self.next_hash, self.next_message, self.drop = "h", _message(settings, nxt, job), ()

    async def scenario() -> list[int]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, keys, "w1", 3)
        await client.set(keys.heartbeat("w1"), "1")
        for pid in ("c/t0", "d/t0"):
            assert (await ledger.claim(job, pid)).state == "new"
        rows = [FinalRow(p, 10, True, False) for p in ("c/t0", "d/t0")]
        turns = [Next("c/t0", "c/t1"), Next("d/t0", "d/t1")]
        counts = []
        for _ in range(3):  # the first call offers; a retried one (its reply lost, a replay) finds them done
            before = AFFINITY["offered"]
            done = await ledger.finalize(job, "ds", rows, 100, 0.9, turns, host, keys.turn_answers(job), offers=offers)
            counts.append((done.offered, AFFINITY["offered"] - before))
        await client.aclose()
        return counts

    assert asyncio.run(scenario()) == [(2, 2), (0, 0), (0, 0)]
    client = redis.Redis.from_url(redis_url)
    assert client.llen(host) == 2 and client.zcard(offers) == 2, "offered once each"
