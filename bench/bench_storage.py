"""Storage write throughput on one core: rows → spans → Arrow → zstd Parquet → committed part.

Run:  .venv/bin/python -m bench.bench_storage [--rows 4096] [--batch-rows 512] [--repeat 3]
      .venv/bin/python -m bench.bench_storage --from-json bench/results/storage.json   # the section only

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
shared machine), then one line ``BENCH_STORAGE {json}`` for scripts; writes bench/results/storage.json
and rewrites its section of BENCHMARKS.md from that JSON.

``--logprobs``: instead, the Parquet size per output token of the same rows without logprobs and with
``--logprobs K`` for K = 0, 5, 20 (zstd, WRITE_OPTIONS; values from the simulator's synthetic model,
``sglang_sim.content.logprob_arrays``), saved as bench/results/storage_logprobs.json and written to its
own section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
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
from storage.writer import PartWriter, encode_parquet
from testing.rows import synthetic_rows
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


def measure_logprobs(rows: int, batch_rows: int) -> dict[str, Any]:
    """Parquet bytes per output token without / with logprobs (K = 0, 5, 20), zstd (WRITE_OPTIONS)."""
    from storage.writer import encode_parquet as encode

    data = synthetic_rows(rows, seed=1, as_numpy=False)
    tables = [rows_to_table(data[i : i + batch_rows]) for i in range(0, rows, batch_rows)]
    out_tokens = sum(len(r["output_ids"]) for r in data)
    base = sum(len(encode(t)) for t in tables)
    result: dict[str, Any] = {
        "rows": rows,
        "batch_rows": batch_rows,
        "output_tokens": out_tokens,
        "bytes_per_output_token": round(base / out_tokens, 3),
        "with_logprobs": {},
    }
    for k in (0, 5, 20):
        size = sum(len(encode(_with_logprobs(t, k))) for t in tables)
        result["with_logprobs"][str(k)] = {
            "bytes_per_output_token": round(size / out_tokens, 3),
            "raw_bytes_added": 4 + 8 * k,  # float32 + (int32 id + float32) per alternative
        }
        print(
            f"K={k:2}: {size / out_tokens:6.2f} bytes/output token (+{(size - base) / out_tokens:.2f}; raw {4 + 8 * k})"
        )
    print(f"no logprobs: {base / out_tokens:.2f} bytes/output token ({rows} rows, {out_tokens} output tokens)")
    return result


def logprobs_markdown(res: dict[str, Any]) -> str:
    base = res["bytes_per_output_token"]
    rows: list[list[object]] = [["none (null columns)", f"{base:.2f}", "—", "—"]]
    for k, v in res["with_logprobs"].items():
        rows.append([f"`--logprobs {k}`", f"{v['bytes_per_output_token']:.2f}",
                     f"+{v['bytes_per_output_token'] - base:.2f}", v["raw_bytes_added"]])  # fmt: skip
    ratio = {k: v["bytes_per_output_token"] / base for k, v in res["with_logprobs"].items()}
    return f"""What it measures: the size of committed Parquet (zstd level 1, `storage.schema.WRITE_OPTIONS`) per
output token of the same rows without logprobs and with `producer submit --logprobs K`
(`output_logprobs` list<float32>, and for K > 0 `top_logprob_ids` list<list<int32>> +
`top_logprobs` list<list<float32>>). Bytes per output token include the prompt ids and every other
column of the row.

Command (~1 min):

    .venv/bin/python -m bench.bench_storage --logprobs --rows {res["rows"]}

{stamp_line(res)}

Data: the synthetic rows of the storage benchmark ({res["rows"]:,} rows, {res["output_tokens"]:,} output tokens,
parts of {res["batch_rows"]}); logprobs from the simulator's synthetic model (`sglang_sim.content.logprob_arrays`:
a descending ladder `0.4·ln U`, gaps `0.05 + Exp(1)`, as float32), alternatives are ids near the sampled one.

{table(["logprobs", "bytes / output token", "added by logprobs", "raw bytes added (uncompressed)"], rows)}

Reading the numbers: logprobs are float32 noise to zstd — the mantissas barely compress, so each
alternative costs most of its raw 8 bytes (the ids compress some: they sit near the sampled id).
Real model logprobs are more skewed (many sampled tokens at logprob ≈ 0) and may compress somewhat
better than these synthetic ones. Budget with these: K = 20 makes a row ~{ratio["20"]:.0f}x the bytes of one
without logprobs; K = 0 (the sampled token only) ~{ratio["0"]:.1f}x.

Raw figures: `bench/results/storage_logprobs.json`.
"""


def stamp_line(res: dict[str, Any]) -> str:
    return f"Run {res.get('date', '?')}. {code_stamp(res.get('code'))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--batch-rows", type=int, default=512, help="rows per part (the worker's flush_rows)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--logprobs", action="store_true", help="measure size per token with logprobs instead")
    parser.add_argument("--out", type=Path, help="JSON (default bench/results/storage.json, storage_logprobs.json)")
    parser.add_argument("--no-markdown", action="store_true", help="don't rewrite the BENCHMARKS.md section")
    parser.add_argument("--from-json", type=Path, help="only rewrite the section from a saved run (runs nothing)")
    args = parser.parse_args()
    name = "storage_logprobs" if args.logprobs else "storage"
    out = args.out or RESULTS / f"{name}.json"
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        code = code_version()  # the tree as the run starts
        res = measure_logprobs(args.rows, args.batch_rows) if args.logprobs else measure_write(args)
        res |= {"date": time.strftime("%Y-%m-%d"), "code": code}
        write_json(out, res)
        print(f"BENCH_{name.upper()} " + json.dumps(_summary(res), sort_keys=True))
    if not args.no_markdown:
        if args.logprobs:
            update_section("bench_storage_logprobs", "Storage size with logprobs", logprobs_markdown(res))
        else:
            update_section("bench_storage", "Storage write", write_markdown(res))


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    if "with_logprobs" in res:
        return {f"k{k}_bytes_per_output_token": v["bytes_per_output_token"] for k, v in res["with_logprobs"].items()}
    return {
        f"{name.replace(' ', '_').replace(',', '')}_rows_per_cpu_s": round(res["rows"] / v["cpu_s"])
        for name, v in res["variants"].items()
    } | {"bytes_per_token": res["bytes_per_token"]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def measure_write(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
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

    print(f"{args.rows} rows in parts of {args.batch_rows}, one core (cpu {cpu}), load {os.getloadavg()[0]:.1f}")
    for name, (wall, cpu_s) in {**results, **stages}.items():
        print(f"  {name:28} {args.rows / wall:9,.0f} rows/s {args.rows / cpu_s:9,.0f} rows/CPU-s")
    tokens = out_tokens + in_tokens
    return {
        "rows": args.rows,
        "batch_rows": args.batch_rows,
        "parts": len(batches),
        "repeat": args.repeat,
        "cpu_model": _cpu_model(),
        "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "variants": {k: {"wall_s": round(w, 5), "cpu_s": round(c, 5)} for k, (w, c) in results.items()},
        "stages": {k: {"wall_s": round(w, 5), "cpu_s": round(c, 5)} for k, (w, c) in stages.items()},
        "bytes_per_token": round(part_bytes / tokens, 3),
        "bytes_per_token_bss": round(bss_bytes / tokens, 3),
    }


def write_markdown(res: dict[str, Any]) -> str:
    rows, parts, v, st = res["rows"], res["parts"], res["variants"], res["stages"]
    out_tok = res["output_tokens"]
    naive_cpu = v["naive baseline"]["cpu_s"]
    labels = {
        "numpy ids": "**thinkfleet, ids as numpy arrays**",
        "list ids": "thinkfleet, ids as Python lists",
        "list ids, spans given": "thinkfleet, lists, spans given by the worker",
        "naive baseline": "naive baseline",
    }
    variants = table(
        [f"variant ({rows:,} rows, parts of {res['batch_rows']})", "rows/s (wall)", "rows/CPU-s",
         "output tokens/CPU-s", "vs naive (CPU)"],
        [[labels.get(k, k), f"{rows / x['wall_s']:,.0f}", f"{rows / x['cpu_s']:,.0f}",
          f"{out_tok / x['cpu_s'] / 1e6:.1f} M", f"{naive_cpu / x['cpu_s']:.1f}x"] for k, x in v.items()],
    )  # fmt: skip
    stage_labels = {
        "rows_to_table": "`rows_to_table` (numpy ids, spans computed for the batch)",
        "compute_spans_batch": "… of which `compute_spans_batch`",
        "encode": "Parquet encode, PLAIN ids + zstd (default)",
        "encode (BSS ids, opt-in)": "Parquet encode, BYTE_STREAM_SPLIT ids + zstd (opt-in)",
        "commit": "commit: temp file, fsync, rename",
    }
    stages = table(
        ["stage", "CPU ms/part", "wall ms/part", "rows/CPU-s"],
        [[stage_labels.get(k, k), f"{x['cpu_s'] / parts * 1e3:.1f}", f"{x['wall_s'] / parts * 1e3:.1f}",
          f"{rows / x['cpu_s']:,.0f}"] for k, x in st.items()],
    )  # fmt: skip
    best = rows / v["numpy ids"]["cpu_s"]
    encode_share = st["encode"]["cpu_s"] / v["numpy ids"]["cpu_s"]
    bss_saving = 1 - st["encode (BSS ids, opt-in)"]["cpu_s"] / st["encode"]["cpu_s"]
    size_saving = 1 - res["bytes_per_token_bss"] / res["bytes_per_token"]
    ids_per_row = (res["output_tokens"] + res["prompt_tokens"]) / rows
    list_cost_us = (v["list ids"]["cpu_s"] - v["numpy ids"]["cpu_s"]) / rows * 1e6
    load = res["load_avg_1m_before_after"]
    return f"""What it measures: the worker's commit path on one core — row dicts → spans → Arrow table → zstd
Parquet → atomically committed part file (`PartWriter.write`, local disk, fsync + rename) — for
group commits of {res["batch_rows"]} rows, against a naive baseline in the same run (per-row Python loop over the
ids for spans + `pa.Table.from_pylist` + `pq.write_table(compression="zstd")` with default
encodings).

Command (pins itself to one CPU and Arrow to one thread; ~1 min):

    .venv/bin/python -m bench.bench_storage --rows {rows} --repeat {res["repeat"]}

{stamp_line(res)}

Data: synthetic Kimi outputs with the seed run's length distribution (lognormal, median 646, capped at
10,240: mean {res["output_tokens"] / rows:,.0f} output and {res["prompt_tokens"] / rows:,.0f} prompt tokens per row
here), Zipf-distributed ids, 90 % closing reasoning with `</think>` and ending in `<|im_end|>`, 10 % truncated.

Machine: {res["cpu_model"]}, one core of the shared 2-vCPU dev VM; 1-minute load average {load[0]} → {load[1]}
during the run (other engineers' tests), so wall times carry that noise. "rows/CPU-s" divides by this
process's own CPU time, the fair one-core figure here. Medians of {res["repeat"]} runs after a warm-up.

{variants}

Where the time goes (per {res["batch_rows"]}-row part, ~{ids_per_row * res["batch_rows"] / 1e3:,.0f} k ids):

{stages}

Size: {res["bytes_per_token"]:.2f} bytes/token with PLAIN+zstd (the default), {res["bytes_per_token_bss"]:.2f} with
BYTE_STREAM_SPLIT+zstd.

Reading the numbers:
- **The 50,000 rows/s target {"is met" if best >= 50_000 else "is not met"} on this machine**: {best:,.0f} rows per
  CPU-second with numpy ids. The Parquet encoder is {encode_share:.0%} of that time, mostly work per id the
  format requires (repetition/definition levels for every list element, zstd). 50 k rows/s of
  ~{ids_per_row:,.0f} ids is {50_000 * ids_per_row / 1e6:.0f} M ids/s, ~{1e9 / (50_000 * ids_per_row):.0f} ns per id
  for everything.
- Python lists cost ~{list_cost_us:.0f} µs more per row than numpy ids (CPython int unboxing into an int32
  buffer). A worker that keeps ids as numpy from the start (the prompt already arrives as packed uint32
  bytes in the task message) gets the numpy row.
- BYTE_STREAM_SPLIT would make the encode ~{bss_saving:.0%} cheaper and the files ~{size_saving:.0%} smaller, but it
  is off by default: INT32 BYTE_STREAM_SPLIT needs pyarrow ≥ 16 and DuckDB only reads it since mid-2026
  (duckdb/duckdb#24175). `storage.schema.BSS_TOKEN_ENCODING` turns it on.
- In production this path is nowhere near the bottleneck: one SGLang server produced ~26 rows/min
  in the seed run, so a worker commits well under one part per second.

Raw figures: `bench/results/storage.json`.
"""


if __name__ == "__main__":
    main()
