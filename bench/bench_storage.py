"""Storage write throughput on one core: rows → spans → Arrow → zstd Parquet → committed part.

Run:  .venv/bin/python -m bench.bench_storage [--rows 4096] [--batch-rows 512] [--repeat 3]

Rows are synthetic Kimi outputs with the seed run's length distribution (median 646, mean ~1,400
tokens, tail to 10,240; prompts median 300) and Zipf-distributed ids, written in group commits of
``--batch-rows`` (the worker's ``flush_rows``) by ``PartWriter.write`` to a local temp dir. The
process is pinned to one CPU and Arrow to one thread. Variants, timed in the same run:

- ``numpy ids``: the worker hands ids as numpy arrays; storage computes spans for the batch.
- ``list ids``: ids as Python lists (what a JSON decode gives); storage computes spans.
- ``list ids, spans given``: as the worker does today (it calls compute_spans per row itself).
- ``naive baseline``: a per-row Python loop over the ids for spans + ``pa.Table.from_pylist`` +
  ``pq.write_table(compression="zstd")`` with default encodings.

Reports rows per wall-second and per CPU-second of this process (the fair "one core" figure on a
shared machine), then one line ``BENCH_STORAGE {json}`` for scripts.

``--logprobs``: instead, the Parquet size per output token of the same rows without logprobs and with
``--logprobs K`` for K = 0, 5, 20 (zstd, WRITE_OPTIONS; values from the simulator's synthetic model,
``sglang_sim.content.logprob_arrays``), written to its own section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bench.report import table, update_section
from storage import layout
from storage.schema import (
    BSS_TOKEN_ENCODING,
    LOGPROBS,
    OUTPUT_LOGPROBS,
    SCHEMA,
    TOP_IDS,
    TOP_LOGPROB_IDS,
    TOP_LOGPROBS,
    TOP_LOGPROBS_TYPE,
    WRITE_OPTIONS,
    rows_to_table,
)
from storage.spans import compute_spans, compute_spans_batch
from storage.testing import synthetic_rows
from storage.writer import PartWriter, encode_parquet
from thinkfleet import kimi


def naive_spans(ids: list[int]) -> dict[str, Any]:
    """The obvious per-token Python loop (reasoning/answer/tool calls/stop), for the baseline."""
    n = len(ids)
    stop = ids[-1] if ids and ids[-1] in kimi.DEFAULT_STOP_TOKEN_IDS else None
    body = n - (stop is not None)
    r_end, a_start, has_end = body, body, False
    a_end = body
    calls, open_at = [], None
    for i in range(body):
        t = ids[i]
        if t in (kimi.THINK_END, kimi.TOOL_CALLS_SECTION_BEGIN) and r_end == body and not has_end:
            r_end, has_end = i, t == kimi.THINK_END
            a_start = i + 1 if has_end else i
        elif t == kimi.TOOL_CALLS_SECTION_BEGIN and a_end == body and i >= a_start:
            a_end = i
        if t == kimi.TOOL_CALL_BEGIN:
            open_at = i
        elif t == kimi.TOOL_CALL_END and open_at is not None:
            calls.append({"start": open_at, "end": i + 1})
            open_at = None
    return {
        "reasoning_start": 0,
        "reasoning_end": r_end,
        "has_think_end": has_end,
        "answer_start": a_start,
        "answer_end": a_end,
        "tool_call_spans": calls,
        "stop_token": stop,
    }


def naive_write(rows: list[dict[str, Any]], path: str) -> None:
    full = []
    for r in rows:
        row = {**r, **naive_spans(r["output_ids"])}
        row["prompt_tokens"], row["completion_tokens"] = len(r["input_ids"]), len(r["output_ids"])
        row["sample_index"], row["revision"], row["attempt"] = 0, 0, 1
        row["sampling_params"] = json.dumps(r["sampling_params"], sort_keys=True)
        full.append(row)
    pq.write_table(pa.Table.from_pylist(full, schema=SCHEMA), path, compression="zstd")


def _fresh_path(writer: PartWriter) -> str:
    return writer.loc.path(writer.part_name("commit", "ds"))


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``repeat`` runs after one warm-up.

    CPU time is this process's own: on a shared machine it is the fairer "one core" figure, since
    wall time also counts the slices other processes took from our core.
    """
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _with_logprobs(t: pa.Table, k: int) -> pa.Table:
    """``t`` with the logprob columns of ``--logprobs k`` (built from flat numpy arrays, as stored)."""
    import numpy as np

    from sglang_sim.content import logprob_arrays

    chosen, values, ids, lengths = [], [], [], []
    for prompt, out in zip(t["input_ids"].to_pylist(), t["output_ids"].to_pylist(), strict=True):
        c, v, i = logprob_arrays(prompt, 7, out, k, 163840)
        chosen.append(c)
        values.append(v.reshape(-1))
        ids.append(i.reshape(-1).astype(np.int32))
        lengths.append(len(out))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    t = t.set_column(
        t.schema.get_field_index(OUTPUT_LOGPROBS),
        OUTPUT_LOGPROBS,
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(chosen)), type=LOGPROBS),
    )
    if k == 0:
        return t
    inner = np.arange(0, offsets[-1] * k + 1, k, dtype=np.int32)
    top_ids = pa.ListArray.from_arrays(inner, pa.array(np.concatenate(ids)), type=TOP_IDS.value_type)
    top_values = pa.ListArray.from_arrays(inner, pa.array(np.concatenate(values)), type=LOGPROBS)
    t = t.set_column(
        t.schema.get_field_index(TOP_LOGPROB_IDS),
        TOP_LOGPROB_IDS,
        pa.ListArray.from_arrays(offsets, top_ids, type=TOP_IDS),
    )
    return t.set_column(
        t.schema.get_field_index(TOP_LOGPROBS),
        TOP_LOGPROBS,
        pa.ListArray.from_arrays(offsets, top_values, type=TOP_LOGPROBS_TYPE),
    )


def logprobs_main(rows: int, batch_rows: int, markdown: bool) -> None:
    """Parquet bytes per output token without / with logprobs (K = 0, 5, 20), zstd (WRITE_OPTIONS)."""
    from storage.writer import encode_parquet as encode

    data = synthetic_rows(rows, seed=1, as_numpy=False)
    tables = [rows_to_table(data[i : i + batch_rows]) for i in range(0, rows, batch_rows)]
    out_tokens = sum(len(r["output_ids"]) for r in data)
    base = sum(len(encode(t)) for t in tables)
    results: list[list[object]] = [["none (null columns)", f"{base / out_tokens:.2f}", "—", "—"]]
    summary: dict[str, Any] = {"rows": rows, "output_tokens": out_tokens, "bytes_per_output_token": base / out_tokens}
    for k in (0, 5, 20):
        size = sum(len(encode(_with_logprobs(t, k))) for t in tables)
        extra = (size - base) / out_tokens
        raw = 4 + 8 * k  # float32 + (int32 id + float32) per alternative
        results.append([f"`--logprobs {k}`", f"{size / out_tokens:.2f}", f"+{extra:.2f}", f"{raw}"])
        summary[f"k{k}_bytes_per_output_token"] = round(size / out_tokens, 3)
        print(f"K={k:2}: {size / out_tokens:6.2f} bytes/output token (+{extra:.2f}; raw {raw})")
    print(f"no logprobs: {base / out_tokens:.2f} bytes/output token ({rows} rows, {out_tokens} output tokens)")
    print("BENCH_STORAGE_LOGPROBS " + json.dumps(summary, sort_keys=True))
    if not markdown:
        return
    body = f"""What it measures: the size of committed Parquet (zstd level 1, `storage.schema.WRITE_OPTIONS`) per
output token of the same rows without logprobs and with `producer submit --logprobs K`
(`output_logprobs` list<float32>, and for K > 0 `top_logprob_ids` list<list<int32>> +
`top_logprobs` list<list<float32>>). Bytes per output token include the prompt ids and every other
column of the row.

Command (~1 min):

    .venv/bin/python -m bench.bench_storage --logprobs --rows {rows}

Data: the synthetic rows of the storage benchmark ({rows:,} rows, {out_tokens:,} output tokens, parts of
{batch_rows}); logprobs from the simulator's synthetic model (`sglang_sim.content.logprob_arrays`: a
descending ladder `0.4·ln U`, gaps `0.05 + Exp(1)`, as float32), alternatives are ids near the sampled one.

{table(["logprobs", "bytes / output token", "added by logprobs", "raw bytes added (uncompressed)"], results)}

Reading the numbers: logprobs are float32 noise to zstd — the mantissas barely compress, so each
alternative costs most of its raw 8 bytes (the ids compress some: they sit near the sampled id).
Real model logprobs are more skewed (many sampled tokens at logprob ≈ 0) and may compress somewhat
better than these synthetic ones. Budget with these: K = 20 makes a row ~55x the bytes of one without
logprobs; K = 0 (the sampled token only) ~2.7x.
"""
    update_section("bench_storage_logprobs", "Storage size with logprobs", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--batch-rows", type=int, default=512, help="rows per part (the worker's flush_rows)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--logprobs", action="store_true", help="measure size per token with logprobs instead")
    parser.add_argument(
        "--no-markdown", action="store_true", help="--logprobs: don't rewrite its BENCHMARKS.md section"
    )
    args = parser.parse_args()
    if args.logprobs:
        logprobs_main(args.rows, args.batch_rows, not args.no_markdown)
        return

    cpu = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {cpu})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)

    numpy_rows = synthetic_rows(args.rows, seed=1, as_numpy=True)
    list_rows = synthetic_rows(args.rows, seed=1, as_numpy=False)
    given_rows = []
    for r in list_rows:  # what the worker sends today: spans computed per row, as dicts
        s = compute_spans(r["output_ids"])
        given_rows.append(
            {
                **r,
                "reasoning_start": s.reasoning_start,
                "reasoning_end": s.reasoning_end,
                "has_think_end": s.has_think_end,
                "answer_start": s.answer_start,
                "answer_end": s.answer_end,
                "stop_token": s.stop_token,
                "tool_call_spans": [{"start": a, "end": b} for a, b in s.tool_call_spans],
            }
        )
    batches = range(0, args.rows, args.batch_rows)
    out_tokens = sum(len(r["output_ids"]) for r in list_rows)
    in_tokens = sum(len(r["input_ids"]) for r in list_rows)

    with tempfile.TemporaryDirectory() as tmp:
        writer = PartWriter(tmp, "bench")

        def write_all(rows: list[dict[str, Any]]) -> Callable[[], None]:
            def run() -> None:
                for i in batches:
                    writer.write("bench", "ds", rows[i : i + args.batch_rows])

            return run

        def naive_all() -> None:
            for n, i in enumerate(batches):
                naive_write(list_rows[i : i + args.batch_rows], os.path.join(tmp, f"naive-{n}.parquet"))

        tables = [rows_to_table(numpy_rows[i : i + args.batch_rows]) for i in batches]
        encoded = [encode_parquet(t) for t in tables]
        flat = [(t["output_ids"].combine_chunks(), t["input_ids"].combine_chunks()) for t in tables]
        results = {
            "numpy ids": timed(write_all(numpy_rows), args.repeat),
            "list ids": timed(write_all(list_rows), args.repeat),
            "list ids, spans given": timed(write_all(given_rows), args.repeat),
            "naive baseline": timed(naive_all, args.repeat),
        }
        stages = {
            "rows_to_table": timed(
                lambda: [rows_to_table(numpy_rows[i : i + args.batch_rows]) for i in batches], args.repeat
            ),
            "compute_spans_batch": timed(
                lambda: [compute_spans_batch(o.values.to_numpy(), o.offsets.to_numpy(), True) for o, _ in flat],
                args.repeat,
            ),
            "encode": timed(lambda: [encode_parquet(t) for t in tables], args.repeat),
            "commit": timed(
                lambda: [
                    layout.write_atomic(writer.loc, writer.loc.path(writer.part_name("c", "ds")), b) for b in encoded
                ],
                args.repeat,
            ),
        }
        part_bytes = sum(len(b) for b in encoded)
        bss = dict(WRITE_OPTIONS, column_encoding=BSS_TOKEN_ENCODING)
        bss_bytes = 0
        for t in tables:
            sink = pa.BufferOutputStream()
            pq.write_table(t, sink, **bss)
            bss_bytes += sink.tell()
        stages["encode (BSS ids, opt-in)"] = timed(
            lambda: [pq.write_table(t, pa.BufferOutputStream(), **bss) for t in tables], args.repeat
        )

    mean_out, mean_in = out_tokens / args.rows, in_tokens / args.rows
    print(
        f"{args.rows} rows in parts of {args.batch_rows}, one core (cpu {cpu}), load {os.getloadavg()[0]:.1f}; "
        f"mean output {mean_out:.0f} tokens, mean prompt {mean_in:.0f} tokens"
    )
    print(f"{'variant':28} {'rows/s':>9} {'rows/CPU-s':>11} {'out tok/CPU-s':>14} {'vs naive':>9}")
    naive_cpu = results["naive baseline"][1]
    summary: dict[str, Any] = {
        "rows": args.rows,
        "batch_rows": args.batch_rows,
        "cpu_count": 1,
        "load_avg_1m": os.getloadavg()[0],
        "mean_output_tokens": round(mean_out),
        "mean_prompt_tokens": round(mean_in),
    }
    for name, (wall, cpu_s) in results.items():
        key = name.replace(" ", "_").replace(",", "")
        print(
            f"{name:28} {args.rows / wall:9,.0f} {args.rows / cpu_s:11,.0f} {out_tokens / cpu_s:14,.0f} "
            f"{naive_cpu / cpu_s:8.1f}x"
        )
        summary[key + "_rows_per_s"] = round(args.rows / wall)
        summary[key + "_rows_per_cpu_s"] = round(args.rows / cpu_s)
    stage_names = {"encode (BSS ids, opt-in)": "encode_bss"}
    for name, (wall, cpu_s) in stages.items():
        print(
            f"  stage {name:26} {args.rows / cpu_s:9,.0f} rows/CPU-s {cpu_s / len(batches) * 1e3:6.1f} CPU-ms/part "
            f"{wall / len(batches) * 1e3:6.1f} wall-ms/part"
        )
        summary["stage_" + stage_names.get(name, name) + "_rows_per_cpu_s"] = round(args.rows / cpu_s)
    bytes_per_token = part_bytes / (out_tokens + in_tokens)
    print(
        f"parquet size: {bytes_per_token:.2f} bytes/token (PLAIN+zstd, the default); "
        f"{bss_bytes / (out_tokens + in_tokens):.2f} with BYTE_STREAM_SPLIT+zstd"
    )
    summary["bytes_per_token"] = round(bytes_per_token, 3)
    summary["bytes_per_token_bss"] = round(bss_bytes / (out_tokens + in_tokens), 3)
    print("BENCH_STORAGE " + json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
