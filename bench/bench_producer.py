"""Producer benchmark: submit vs. the tokenizer alone, fast enqueue vs. naive apply_async, Redis bytes/token.

    .venv/bin/python bench/bench_producer.py                 # 88,088 prompts of ~800 tokens (minutes)
    .venv/bin/python bench/bench_producer.py --prompts 20000 # smaller, same figures

Everything runs against a private ``redis-server --save ''`` on a free port (never the shared
127.0.0.1:6379). The Kimi-shaped test tokenizer (thinkfleet.testing.tokenizer) stands in for Kimi's;
its ids are scattered over the full 163,584-id range, so compression is not flattered by small ids.

Figures, all from one run:
- tokenizer alone: the same cores render + encode every conversation (``apply_chat_template`` +
  ``tokenizer(texts)``) in a process pool, conversations already in memory, results dropped;
- submit: ``producer submit`` end to end from the JSONL file (read, validate, tokenizer load, render,
  pack, stage, commit, job record, storage manifest);
- enqueue alone: already-tokenized prompts → Redis with the fast path; naive: ``apply_async`` per prompt
  with Celery's default JSON serializer and the ids as a list of ints (also its Redis bytes/token);
- Redis memory: INFO used_memory delta of the submit (all keys) ÷ prompt tokens, and MEMORY USAGE of
  the queue list alone.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from producer import render
from producer.enqueue import Envelope, Stager
from producer.submit import SubmitOptions, submit
from thinkfleet.message import TASK_NAME, PromptTask, unpack_ids
from thinkfleet.settings import Settings
from thinkfleet.testing.datasets import chat_rows, write_jsonl
from thinkfleet.testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# -- the tokenizer alone ------------------------------------------------------------------------------------
_TOK: Any = None


def _tokenize_only(batch: list[list[dict[str, Any]]]) -> int:
    texts = [_TOK.apply_chat_template(m, tokenize=False, add_generation_prompt=True, thinking=True) for m in batch]
    return sum(len(ids) for ids in _TOK(texts, add_special_tokens=False)["input_ids"])


def tokenizer_alone(tok_dir: Path, conversations: list[list[dict[str, Any]]], processes: int) -> tuple[float, int]:
    global _TOK
    _TOK = render.load_tokenizer(str(tok_dir))
    batches = [conversations[i : i + 64] for i in range(0, len(conversations), 64)]
    started = time.perf_counter()
    with mp.get_context("fork").Pool(processes) as pool:
        tokens = sum(pool.imap(_tokenize_only, batches, chunksize=1))
    return time.perf_counter() - started, tokens


# -- enqueue ------------------------------------------------------------------------------------------------
def fast_enqueue(client: redis.Redis, settings: Settings, tasks: list[PromptTask]) -> float:
    started = time.perf_counter()
    envelope = Envelope(settings)
    stager = Stager(client, settings.keys, "bench", settings.queue)
    for i in range(0, len(tasks), 64):
        stager.push(envelope.encode_many(tasks[i : i + 64]))
    stager.commit()
    return time.perf_counter() - started


def naive_enqueue(redis_url: str, tasks: list[PromptTask], queue: str) -> float:
    """What a first version does: apply_async per prompt, default JSON serializer, ids as a list of ints."""
    from celery import Celery

    app = Celery("naive", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True, broker_connection_retry_on_startup=True)

    @app.task(name=TASK_NAME)
    def generate(*args: Any) -> None: ...

    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for t in tasks:
            args = [t.job, t.dataset, t.prompt_id, t.row_index, t.content_hash, unpack_ids(t.ids_blob)]
            generate.apply_async(args=args, task_id=t.task_id, producer=producer)
    return time.perf_counter() - started


def cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the render pools)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def queued_tasks(client: redis.Redis, queue: str) -> list[PromptTask]:
    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        body = json.loads(raw)["body"]
        out.append(PromptTask.from_args(msgpack.unpackb(base64.b64decode(body), raw=False)[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=88_088)
    ap.add_argument("--words", type=int, default=440, help="user-turn words (~1.7 tokens each)")
    ap.add_argument("--processes", type=int, default=os.cpu_count())
    ap.add_argument("--naive", type=int, default=3000, help="prompts for the naive apply_async baseline")
    ap.add_argument("--repeat", type=int, default=2, help="alternating baseline/submit runs (best counts)")
    ap.add_argument("--json", dest="json_out", help="also write the figures here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-producer-"))
    proc, url = start_redis(work)
    client = redis.Redis.from_url(url)
    try:
        tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
        rows = chat_rows(args.prompts, words=args.words, seed=7)
        data = write_jsonl(work / "bench.jsonl", rows)
        conversations = [r["messages"][:2] for r in rows]
        del rows
        print(f"{args.prompts:,} prompts, {args.processes} processes, load {os.getloadavg()[0]:.2f}", flush=True)

        settings = Settings(redis_url=url, output_uri=str(work / "out"))
        # Baseline and submit alternate, so a neighbour's load hits both alike; the best run of each counts.
        tok_runs, submit_runs = [], []
        for _ in range(args.repeat):
            c0 = cpu_s()
            t_tok, tokens = tokenizer_alone(tok_dir, conversations, args.processes)
            tok_runs.append((t_tok, cpu_s() - c0))
            print(f"tokenizer alone: {t_tok:.1f} s ({tok_runs[-1][1]:.1f} CPU s), {tokens:,} tokens "
                  f"({tokens / t_tok:,.0f} tokens/s)", flush=True)  # fmt: skip
            client.flushall()
            shutil.rmtree(work / "out", ignore_errors=True)
            opts = SubmitOptions(paths=[data], job="bench", tokenizer=str(tok_dir), processes=args.processes)
            render._LOADED.clear()  # submit loads the tokenizer itself, as the CLI would
            before = used_memory(client)
            c0, started = cpu_s(), time.perf_counter()
            report = submit(settings, opts)
            t_submit = time.perf_counter() - started
            submit_runs.append((t_submit, cpu_s() - c0))
            after = used_memory(client)
            print(f"submit: {t_submit:.1f} s ({submit_runs[-1][1]:.1f} CPU s) = {t_submit / t_tok:.2f}× the "
                  f"tokenizer alone; {report.enqueued:,} prompts", flush=True)  # fmt: skip
        t_tok, cpu_tok = min(tok_runs)
        t_submit, cpu_submit = min(submit_runs)
        queue_bytes = int(client.memory_usage(settings.queue, samples=0) or 0)
        queued_tokens = report.prompt_tokens_enqueued
        print(
            f"redis: {(after - before) / queued_tokens:.2f} B/token all keys (INFO used_memory), "
            f"{queue_bytes / queued_tokens:.2f} B/token queue list (MEMORY USAGE); "
            f"dry-run estimate {report.estimated_redis_bytes / (after - before):.2f}× measured",
            flush=True,
        )

        tasks = queued_tasks(client, settings.queue)
        client.flushdb()
        t_fast = fast_enqueue(client, settings, tasks)
        print(f"enqueue alone (fast path): {len(tasks) / t_fast:,.0f} prompts/s", flush=True)
        client.flushdb()
        naive = tasks[: args.naive]
        t_naive = naive_enqueue(url, naive, "naive")
        naive_tokens = sum(len(unpack_ids(t.ids_blob)) for t in naive)
        naive_bytes = int(client.memory_usage("naive", samples=0) or 0)
        print(f"naive apply_async (JSON, int list): {len(naive) / t_naive:,.0f} prompts/s, "
              f"{naive_bytes / naive_tokens:.2f} B/token queue list", flush=True)  # fmt: skip

        figures = {
            "prompts": args.prompts,
            "processes": args.processes,
            "prompt_tokens": queued_tokens,
            "mean_prompt_tokens": round(queued_tokens / max(1, report.enqueued), 1),
            "tokenizer_alone_s": round(t_tok, 2),
            "submit_s": round(t_submit, 2),
            "submit_over_tokenizer": round(t_submit / t_tok, 3),
            "tokenizer_alone_cpu_s": round(cpu_tok, 1),
            "submit_cpu_s": round(cpu_submit, 1),
            "submit_over_tokenizer_cpu": round(cpu_submit / cpu_tok, 3),
            "load_average": round(os.getloadavg()[0], 2),
            "fast_enqueue_prompts_per_s": round(len(tasks) / t_fast),
            "naive_enqueue_prompts_per_s": round(len(naive) / t_naive),
            "redis_bytes_per_token_all_keys": round((after - before) / queued_tokens, 3),
            "redis_bytes_per_token_queue": round(queue_bytes / queued_tokens, 3),
            "naive_redis_bytes_per_token_queue": round(naive_bytes / naive_tokens, 3),
            "dry_run_estimate_over_measured": round(report.estimated_redis_bytes / (after - before), 3),
        }
        print(json.dumps(figures, indent=2))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
