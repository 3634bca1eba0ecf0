"""``bench_scale --turns-conversations N``: `producer status` at the end of a ``--turns all`` job (issue 44 part 3).

A job of N conversations × 4 turns is built finished through the real code paths: the job record with its
``turns`` field, the conversation records, turn 0 submitted, and a real ``Ledger`` finalizing every turn in group
commits (finalize.lua records each answer — a decoded answer of ``--answer-bytes``, ~10 KB as a real one — enqueues
the next turn and writes the conversation's chain state). Then, with nothing pending, ``StatusReader.read()`` (in
process) and ``producer status --json`` (a subprocess) are timed twice: reading the chain state (now), and with the
chain state set aside — the walk along every answer record that a job recorded without it still takes (before).
Status reads the chains' counters and the states of the chains still waiting (none, at the end of a finished job).
Redis time per call: INFO commandstats ``usec`` (the commands' own time) and the server's CPU; Redis bytes per
conversation: ``MEMORY USAGE`` of the chain-state hash and of the answers hash, ÷ conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
from testing.redis_process import RedisProcess
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.state.ledger import FinalRow, Ledger

JOB = "scaleturns"
DATASET = "chat"
TURNS = 4
#: Rows per finalize call (a worker's group commit, Settings.flush_rows).
GROUP = 512
#: StatusReader reads timed per mode (the median is shown): the walk along every answer takes seconds each.
READS = {"chain_state": 7, "answers_walk": 3}


def _answer(pid: str, size: int) -> str:
    """A decoded answer record of about ``size`` bytes (its text; a real one also carries reasoning and ids)."""
    return json.dumps({"role": "assistant", "content": ("x" * size) if size else "", "id": pid})


def build(client: redis.Redis, settings: Settings, conversations: int, answer_bytes: int) -> dict[str, Any]:
    """The finished job: every turn of every conversation finalized through the real ledger."""
    keys = settings.keys
    before = int(client.info("memory")["used_memory"])
    started = time.monotonic()
    record = JobRecord(name=JOB, created_at=time.time())
    record.generation, record.datasets, record.prompts = uuid.uuid4().hex[:16], {DATASET: conversations}, conversations
    record.save(client, keys)
    meta = {"mode": "all", "conversations": conversations, "turns": conversations * TURNS, "cut_at_tool": 0}
    client.hset(keys.job(JOB), "turns", json.dumps(meta))
    convs = [f"{DATASET}/c{i}" for i in range(conversations)]
    message = {"role": "user", "content": "y" * 200}
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, conversations, 2000):
            chunk = convs[start : start + 2000]
            record_of = {
                c: json.dumps({"messages": [message] * (2 * TURNS), "turn_count": TURNS, "row_index": i + start})
                for i, c in enumerate(chunk)
            }
            pipe.hset(keys.conversations(JOB), mapping=record_of)
            pipe.hset(keys.prompts(JOB), mapping={f"{c}/t0": "0" * 16 for c in chunk})
            pipe.hset(keys.prompt_dataset(JOB), mapping={f"{c}/t0": DATASET for c in chunk})
        pipe.hset(keys.counters(JOB), "submitted", conversations)
        pipe.hset(keys.dataset_counters(JOB, DATASET), "submitted", conversations)
        pipe.execute()
    asyncio.run(_finalize_all(settings, convs, answer_bytes))
    after = int(client.info("memory")["used_memory"])
    return {
        "build_s": round(time.monotonic() - started, 1),
        "redis_bytes_per_conversation": round((after - before) / conversations),
        "chain_state_bytes_per_conversation": round((client.memory_usage(keys.chain_state(JOB)) or 0) / conversations),
        "chain_waiting_members": int(client.scard(keys.chain_waiting(JOB))),
        "answers_bytes_per_conversation": round((client.memory_usage(keys.turn_answers(JOB)) or 0) / conversations),
    }


async def _finalize_all(settings: Settings, convs: list[str], answer_bytes: int) -> None:
    from workers.turns import NextTurn

    client = aioredis.from_url(settings.redis_url)
    await client.set(settings.keys.heartbeat("w1"), "1")
    ledger = Ledger(client, settings.keys, "w1")
    scratch = f"{settings.queue}-bench-next"
    try:
        for turn in range(TURNS):  # turn by turn, as the chains go
            for start in range(0, len(convs), GROUP):
                chunk = convs[start : start + GROUP]
                rows, nexts = [], []
                for c in chunk:
                    pid = f"{c}/t{turn}"
                    rows.append(FinalRow(pid, 800, True, False))
                    following = f"{c}/t{turn + 1}" if turn + 1 < TURNS else ""
                    nexts.append(NextTurn(pid, _answer(pid, answer_bytes), following, "0" * 16 if following else "",
                                          b"m" if following else b""))  # fmt: skip
                done = await ledger.finalize(JOB, DATASET, rows, 1000, 0.5, turns=nexts, queue=scratch,
                                             answers=settings.keys.turn_answers(JOB))  # fmt: skip
                assert done.new == len(rows), done
            await client.delete(scratch)  # the next turns' messages: a worker would pop them
    finally:
        await client.aclose()


def _commandstats_usec(client: redis.Redis) -> tuple[int, int]:
    calls = usec = 0
    for name, stats in client.info("commandstats").items():
        if name.startswith("cmdstat_"):
            calls += int(stats["calls"])
            usec += int(stats["usec"])
    return calls, usec


def measure_reads(settings: Settings, reads: int) -> dict[str, Any]:
    """``StatusReader.read()`` ``reads`` times: wall (median), Redis command time and bytes read per call."""
    from producer.status import StatusReader

    client = redis.Redis.from_url(settings.redis_url)
    reader = StatusReader(client, settings, JOB)
    st = reader.read()  # connection open, imports done
    walls, usecs, calls = [], [], []
    for _ in range(reads):
        c0, u0 = _commandstats_usec(client)
        t = time.perf_counter()
        st = reader.read()
        walls.append(time.perf_counter() - t)
        c1, u1 = _commandstats_usec(client)
        usecs.append(u1 - u0)
        calls.append(c1 - c0 - 1)  # less the INFO that measured it
    net = client.info("stats")
    client.close()
    return {
        "finished": st["finished"],
        "complete": (st.get("conversations") or {}).get("complete"),
        "read_ms_median": round(float(np.median(walls)) * 1e3, 2),
        "redis_ms_per_read_median": round(float(np.median(usecs)) / 1e3, 3),
        "redis_commands_per_read": round(float(np.median(calls)), 1),
        "net_output_bytes": int(net.get("total_net_output_bytes", 0)),
    }


def measure(settings: Settings, conversations: int, answer_bytes: int, run_cli: Any) -> dict[str, Any]:
    """Build the finished job; time status reading the chain state (now) and walking the answers (before)."""
    client = redis.Redis.from_url(settings.redis_url)
    figures: dict[str, Any] = {"conversations": conversations, "turns": TURNS, "answer_bytes": answer_bytes}
    figures.update(build(client, settings, conversations, answer_bytes))
    out: dict[str, Any] = {}
    for mode in ("chain_state", "answers_walk"):
        if mode == "answers_walk":  # as a job recorded without it: status walks every answer record
            client.rename(settings.keys.chain_state(JOB), f"{settings.keys.chain_state(JOB)}:aside")
        net0 = int(client.info("stats")["total_net_output_bytes"])
        reads = measure_reads(settings, READS[mode])
        reads["bytes_per_read"] = round((reads.pop("net_output_bytes") - net0) / (READS[mode] + 1))
        cli = run_cli(settings, "status", JOB, "--json")
        cli.pop("stdout", None)
        out[mode] = {"read": reads, "cli": cli}
    client.close()
    figures["modes"] = out
    return figures


def markdown(r: dict[str, Any]) -> str:
    n = r["conversations"]
    rows = []
    for mode, label in (("chain_state", "chain state (now)"), ("answers_walk", "walk every answer (before)")):
        m = r["modes"][mode]
        rows.append([
            label, f"{m['read']['read_ms_median']:,.1f} ms", f"{m['read']['redis_ms_per_read_median']:,.2f} ms",
            f"{m['read']['redis_commands_per_read']:,.0f}", f"{m['read']['bytes_per_read'] / 2**20:,.2f} MiB",
            f"{m['cli']['wall_s']:.2f} s", f"{m['cli']['peak_rss_mb']:,.0f} MiB",
        ])  # fmt: skip
    return "\n".join([
        f"**{n:,} conversations × {r['turns']} turns, finished** (answers of ~{r['answer_bytes']:,} bytes): "
        f"Redis holds {r['redis_bytes_per_conversation']:,} bytes per conversation in all, of which the chain "
        f"state {r['chain_state_bytes_per_conversation']:,} and the answer records "
        f"{r['answers_bytes_per_conversation']:,}.",
        "",
        table(["status reads", "read (median)", "Redis per read", "cmds", "bytes read", "status CLI", "CLI RSS"], rows),
        "",
        "*read* = `StatusReader.read()` in process (what scales); *Redis per read* = INFO commandstats `usec` (median);"
        " *bytes read* = the server's network output per read. *status CLI* = one `python -m producer.cli status "
        "--json` subprocess, interpreter start and imports included (most of it when status reads the chain state; "
        "this 2-core box was shared with other test runs, so its wall time carries their load).",
    ])  # fmt: skip


#: Where ``--turns-conversations`` saves its figures.
TURNS_JSON = "scale_turns.json"


def main(args: argparse.Namespace, run_cli: Any) -> None:
    """``bench_scale --turns-conversations N`` (``run_cli``: bench_scale's timed ``producer`` subprocess)."""
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="bench-scale-turns-") as tmp:
            server = RedisProcess(Path(tmp)).start()
            try:
                settings = Settings(redis_url=server.url(0), output_uri=str(Path(tmp) / "out"), key_prefix="bs",
                                    queue="bsq")  # fmt: skip
                print(f"[{args.turns_conversations:,} conversations] building the finished job …", flush=True)
                figures = measure(settings, args.turns_conversations, args.answer_bytes, run_cli)
            finally:
                server.stop(kill=True)
        figures["code"] = code_version()
        print(json.dumps(figures, indent=1), flush=True)
        write_json(RESULTS / TURNS_JSON, figures)
    command = f"`.venv/bin/python -m bench.bench_scale --turns-conversations {figures['conversations']}`"
    body = "\n\n".join([f"{command} — {__doc__.split(chr(10), 2)[2].strip()}",
                         markdown(figures), code_stamp(figures.get("code"))])  # fmt: skip
    update_section("bench_scale_turns", "Scale: status at the end of a --turns all job", body)
