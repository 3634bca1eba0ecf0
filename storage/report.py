"""``producer report JOB``: what the job produced, at a glance.

Counts per dataset, output-length and reasoning-share distributions, finish reasons and truncation,
tokens/s over time (from ``created_at``) and per-worker totals — computed from the committed view's
scalar columns only (lengths come from ``completion_tokens`` and the spans, never the id lists),
printed with rich, and drawn into ``report.png`` plus a small ``report.html``.

The job record (Redis, when it answers) says which model profile made the rows: ``model_family``, and
whether the rows carry reasoning spans at all — a job run with ``--no-reasoning-spans`` reports no
reasoning share and no ``</think>`` rate (``None``) instead of a misleading 0. Without the record, null span
columns (not recorded) say the same. A ``--turns all`` job also counts its conversations and turn rows.

What served the job comes from its provenance records (``{job}/_provenance/``, storage/manifest.py): each distinct
server configuration — SGLang version, model, weight version, launch arguments — with the workers and hosts that
ran it and its rows (by their ``server_config``); and, where a server ran speculative decoding, the rows'
acceptance figures (accept rate, accept length, the spread over rows).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import layout, stream
from storage.card import card_facts, card_markdown
from storage.flags import FLAG_NAMES
from storage.manifest import job_facts, read_provenance, server_configs
from storage.prefix_cache import PREFIX_COLUMNS, prefix_rows, prefix_summary
from storage.schema import (
    COMPLETION_TOKENS,
    CONVERSATION_ID,
    CREATED_AT,
    DATASET,
    EMPTY_ANSWER,
    FINISH_REASON,
    HAS_THINK_END,
    LATENCY_S,
    LOOP,
    NO_THINK_END,
    PROMPT_ID,
    PROMPT_TOKENS,
    REASONING_END,
    REASONING_START,
    SCHEMA,
    SERVER_CONFIG,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_VERIFY_CT,
    TOOL_CALL_SPANS,
    TOOL_CALL_UNPARSED,
    TURN_COUNT,
    TURN_INDEX,
    WORKER,
)
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord

_COLUMNS = [
    PROMPT_ID,
    DATASET,
    PROMPT_TOKENS,
    COMPLETION_TOKENS,
    REASONING_START,
    REASONING_END,
    HAS_THINK_END,
    FINISH_REASON,
    TOOL_CALL_SPANS,
    LATENCY_S,
    WORKER,
    CREATED_AT,
    CONVERSATION_ID,
    TURN_INDEX,
    TURN_COUNT,
    SERVER_CONFIG,
    SPEC_VERIFY_CT,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
]
_COLUMNS += [LOOP, NO_THINK_END, EMPTY_ANSWER, TOOL_CALL_UNPARSED]  # quality flags (the data card: storage/card.py)
_COLUMNS += [c for c in PREFIX_COLUMNS if c not in _COLUMNS]  # --turns all: the prefix cache (storage/prefix_cache.py)
_PERCENTILES = (50, 90, 99)
#: Most points on the tokens/s timeline; buckets widen to stay under it.
MAX_TIMELINE_POINTS = 120


def report_job(
    settings: Settings,
    job: str,
    out_dir: str | None = None,
    *,
    gpus_per_host: int | None = None,
    usd_per_gpu_hour: float | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Compute the summary (with the data card's facts under ``card``: storage/card.py); with ``out_dir``, also
    write card.md, report.png and report.html there."""
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    table = committed_table(settings, job)
    from storage import jobstate

    state = jobstate.load_job_state(settings, job, timeout_s=2.0)
    record = JobRecord.from_dict(state.record, name=job) if state.record else None
    summary = summarize(job, table, record)
    summary.update(provenance(read_provenance(loc, job), table))
    summary["prefix_cache"] = prefix_summary(table)
    summary["card"] = card_facts(summary, table, state, gpus_per_host=gpus_per_host, usd_per_gpu_hour=usd_per_gpu_hour)
    written: list[str] = []
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        card_path = os.path.join(out_dir, "card.md")
        with open(card_path, "w", encoding="utf-8") as f:
            f.write(card_markdown(summary["card"], ["report.png"]))
        png = plot_png(summary, table)
        png_path = os.path.join(out_dir, "report.png")
        with open(png_path, "wb") as f:
            f.write(png)
        html_path = os.path.join(out_dir, "report.html")
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(to_html(summary, png))
        written = [card_path, png_path, html_path]
    return summary, written


def committed_table(settings: Settings, job: str) -> pa.Table:
    """The committed view's scalar columns the report and card read (ids never), streamed (storage/stream.py):
    memory ~ the job's per-prompt numbers, not its rows."""
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    tables = list(stream.committed_batches(loc, job, _COLUMNS, memory_bytes=stream.memory_bytes_of(settings)))
    schema = pa.schema([SCHEMA.field(c) for c in _COLUMNS])
    return pa.Table.from_batches([b for t in tables for b in t.to_batches()], schema=schema).combine_chunks()


def summarize(job: str, table: pa.Table, record: JobRecord | None = None) -> dict[str, Any]:
    """The numbers of the report; ``record`` (the job record, None when unknown) names the model profile."""
    rows = table.num_rows
    # Null spans are "not recorded" (--no-reasoning-spans); statistics cover the rows that have them.
    recorded = table[REASONING_END].is_valid().to_numpy(zero_copy_only=False)
    spans_on = record.reasoning_spans if record is not None else bool(rows == 0 or recorded.any())
    out_len = table[COMPLETION_TOKENS].to_numpy().astype(np.int64)
    reasoning = (table[REASONING_END].fill_null(0).to_numpy() - table[REASONING_START].fill_null(0).to_numpy()).astype(
        np.int64
    )
    share = np.divide(reasoning, out_len, out=np.zeros(rows), where=out_len > 0)[recorded]
    closed = table[HAS_THINK_END].fill_null(False).to_numpy()[recorded]
    finish = _counts(table[FINISH_REASON])
    tokens = int(out_len.sum())
    summary: dict[str, Any] = {
        "job": job,
        "model_family": record.model_family if record is not None else None,
        "reasoning_spans": spans_on,
        "rows": rows,
        "output_tokens": tokens,
        "prompt_tokens": int(pc.sum(table[PROMPT_TOKENS]).as_py() or 0),
        "reasoning_tokens": int(reasoning.sum()) if spans_on else None,
        "datasets": _counts(table[DATASET]),
        "finish_reasons": finish,
        "truncation_rate": finish.get("length", 0) / rows if rows else 0.0,
        "think_end_rate": (float(closed.mean()) if len(closed) else 0.0) if spans_on else None,
        "tool_call_rows": int((pc.list_value_length(table[TOOL_CALL_SPANS]).to_numpy() > 0).sum()),
        "output_length": _distribution(out_len),
        "over_2000": int((out_len > 2000).sum()),
        "over_5000": int((out_len > 5000).sum()),
        "reasoning_share": _distribution(share) if spans_on else {},
        "latency_s": _distribution(table[LATENCY_S].drop_null().to_numpy()),
    }
    summary.update(_turns(table))
    summary.update(_throughput(table, out_len))
    return summary


def provenance(records: list[dict[str, Any]], table: pa.Table) -> dict[str, Any]:
    """The servers that made the rows (their records, grouped by configuration, with each one's rows), what the
    records say of the job, records that could not be read, and the speculative-decoding figures."""
    configs = table[SERVER_CONFIG] if SERVER_CONFIG in table.column_names else pa.nulls(table.num_rows, pa.string())
    rows = {c["values"]: int(c["counts"]) for c in pc.value_counts(configs).to_pylist()} if table.num_rows else {}
    return {
        "servers": server_configs(records, rows),
        "job_facts": job_facts(records),
        "unreadable_provenance": [r for r in records if "error" in r],
        "speculative": _speculative(table),
    }


def _speculative(table: pa.Table) -> dict[str, Any] | None:
    """Acceptance over the rows that carry it (None when no row does): draft tokens accepted / proposed, output
    tokens per verify step, and the spread of the per-row accept rate (how well the server's drafter already
    predicts each sample)."""
    if SPEC_VERIFY_CT not in table.column_names or table[SPEC_VERIFY_CT].null_count == table.num_rows:
        return None
    spec = table.filter(pc.is_valid(table[SPEC_VERIFY_CT]))
    steps = spec[SPEC_VERIFY_CT].to_numpy().astype(np.int64)
    accepted = spec[SPEC_ACCEPTED_TOKENS].fill_null(0).to_numpy().astype(np.int64)
    proposed = spec[SPEC_DRAFT_TOKENS].fill_null(0).to_numpy().astype(np.int64)
    tokens = spec[COMPLETION_TOKENS].to_numpy().astype(np.int64)
    per_row = np.divide(accepted, proposed, out=np.zeros(len(steps)), where=proposed > 0)[proposed > 0]
    return {
        "rows": spec.num_rows,
        "verify_steps": int(steps.sum()),
        "accepted_tokens": int(accepted.sum()),
        "draft_tokens": int(proposed.sum()),
        "accept_rate": float(accepted.sum() / proposed.sum()) if proposed.sum() else None,
        "accept_length": float(tokens.sum() / steps.sum()) if steps.sum() else None,
        "row_accept_rate": _distribution(per_row),
    }


def _turns(table: pa.Table) -> dict[str, Any]:
    """``--turns all``: conversations, turn rows, and conversations with every turn stored (``turn_count`` of
    them); None for a single-turn job (no row has a conversation)."""
    if CONVERSATION_ID not in table.column_names or table[CONVERSATION_ID].null_count == table.num_rows:
        return {"conversations": None, "turns": None, "complete_conversations": None}
    turns = table.filter(pc.is_valid(table[CONVERSATION_ID])).select([CONVERSATION_ID, TURN_INDEX, TURN_COUNT])
    per_conv = turns.group_by(CONVERSATION_ID).aggregate([(TURN_INDEX, "count_distinct"), (TURN_COUNT, "max")])
    stored = per_conv[f"{TURN_INDEX}_count_distinct"].to_numpy()
    wanted = per_conv[f"{TURN_COUNT}_max"].fill_null(0).to_numpy()
    return {
        "conversations": per_conv.num_rows,
        "turns": turns.num_rows,
        "complete_conversations": int((stored >= wanted).sum()),
    }


def _counts(column: pa.ChunkedArray) -> dict[str, int]:
    values = column.cast(pa.string()) if pa.types.is_dictionary(column.type) else column
    counts = pc.value_counts(values).to_pylist()
    return dict(sorted((str(c["values"]), int(c["counts"])) for c in counts))


def _distribution(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    out = {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}
    out.update({f"p{p}": float(v) for p, v in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True)})
    return out


def _throughput(table: pa.Table, out_len: np.ndarray) -> dict[str, Any]:
    """Output tokens/s over time (by created_at) and per worker."""
    if table.num_rows == 0:
        return {"tokens_per_s": 0.0, "timeline": [], "workers": {}}
    t_us = table[CREATED_AT].cast(pa.int64()).to_numpy()
    t0, t1 = int(t_us.min()), int(t_us.max())
    span_s = max((t1 - t0) / 1e6, 1e-9)
    bucket_s = max(1.0, float(np.ceil(span_s / MAX_TIMELINE_POINTS)))
    bucket = ((t_us - t0) / 1e6 // bucket_s).astype(np.int64)
    per_bucket = np.bincount(bucket, weights=out_len)
    timeline = [
        {"t_s": float(i * bucket_s), "tokens_per_s": float(v / bucket_s), "rows": int(c)}
        for i, (v, c) in enumerate(zip(per_bucket, np.bincount(bucket), strict=True))
    ]
    workers: dict[str, dict[str, Any]] = {}
    names = np.array(table[WORKER].to_pylist(), dtype=object)
    for name in sorted(set(names.tolist())):
        mine = names == name
        w_t = t_us[mine]
        w_span = max((int(w_t.max()) - int(w_t.min())) / 1e6, bucket_s)
        workers[name] = {
            "rows": int(mine.sum()),
            "output_tokens": int(out_len[mine].sum()),
            "tokens_per_s": float(out_len[mine].sum() / w_span),
        }
    return {
        "first_row_at": pc.min(table[CREATED_AT]).as_py().isoformat(),
        "last_row_at": pc.max(table[CREATED_AT]).as_py().isoformat(),
        "tokens_per_s": float(out_len.sum() / span_s) if t1 > t0 else 0.0,
        "timeline_bucket_s": bucket_s,
        "timeline": timeline,
        "workers": workers,
    }


def plot_png(summary: dict[str, Any], table: pa.Table) -> bytes:
    """Four panels: output lengths, reasoning share, tokens/s over time, tokens per worker."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    out_len = table[COMPLETION_TOKENS].to_numpy()
    ax = axes[0][0]
    ax.hist(out_len, bins=50, color="#4c72b0")
    ax.set(title="output length (tokens)", xlabel="tokens", ylabel="rows")
    ax = axes[0][1]
    recorded = table[REASONING_END].is_valid().to_numpy(zero_copy_only=False)  # null: not recorded
    reasoning = table[REASONING_END].fill_null(0).to_numpy() - table[REASONING_START].fill_null(0).to_numpy()
    share = np.divide(reasoning, out_len, out=np.zeros(len(out_len)), where=out_len > 0)
    ax.hist(share[recorded], bins=40, range=(0, 1), color="#55a868")
    title = "reasoning share of output" if recorded.any() or not len(recorded) else "reasoning spans not recorded"
    ax.set(title=title, xlabel="reasoning / output tokens", ylabel="rows")
    ax = axes[1][0]
    timeline = summary.get("timeline") or []
    ax.plot([p["t_s"] / 60 for p in timeline], [p["tokens_per_s"] for p in timeline], color="#c44e52")
    ax.set(title="output tokens/s over time", xlabel="minutes since first row", ylabel="tokens/s")
    ax = axes[1][1]
    workers = summary.get("workers") or {}
    ax.barh(list(workers), [w["output_tokens"] for w in workers.values()], color="#8172b2")
    ax.set(title="output tokens per worker", xlabel="tokens")
    fig.suptitle(f"thinkfleet job {summary['job']}: {summary['rows']} rows")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def to_html(summary: dict[str, Any], png: bytes) -> str:
    """A self-contained page: headline numbers, tables, and the plots inline."""

    def table(title: str, rows: dict[str, Any]) -> str:
        body = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>" for k, v in rows.items())
        return f"<h2>{html.escape(title)}</h2><table>{body}</table>"

    keys = ("model_family", "rows", "conversations", "turns", "output_tokens", "reasoning_tokens")
    keys += ("truncation_rate", "think_end_rate")
    headline = {k: summary[k] for k in (*keys, "tokens_per_s") if summary.get(k) is not None}
    if not summary.get("reasoning_spans", True):
        headline["reasoning spans"] = "off (--no-reasoning-spans)"
    workers = {
        k: f"{v['rows']} rows, {v['output_tokens']} tokens, {v['tokens_per_s']:.1f} tok/s"
        for k, v in (summary.get("workers") or {}).items()
    }
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>thinkfleet {html.escape(summary['job'])}</title>",
        "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style>",
        f"<h1>thinkfleet job {html.escape(summary['job'])}</h1>",
        table("summary", headline),
        table("datasets", summary["datasets"]),
        table("finish reasons", summary["finish_reasons"]),
        table("output length (tokens)", summary["output_length"]),
        table("reasoning share", summary["reasoning_share"]),
        table("workers", workers),
        *(table(f"server {s.get('server_config')}", _server_rows(s)) for s in summary.get("servers") or []),
        table("speculative decoding", summary.get("speculative") or {}),
        table("prefix cache", prefix_rows(summary.get("prefix_cache"))),
        f"<img alt='plots' src='data:image/png;base64,{base64.b64encode(png).decode()}'>",
    ]
    return "\n".join(parts)


def _server_rows(server: dict[str, Any]) -> dict[str, Any]:
    workers = ", ".join(f"{w.get('worker')} ({w.get('host')})" for w in server.get("workers") or [])
    return {
        "SGLang": server.get("sglang_version"),
        "rows": server.get("rows", 0),
        **(server.get("highlights") or {}),
        "workers": workers or "no record",
    }


def _fmt(value: Any) -> str:
    return (
        f"{value:,.3f}"
        if isinstance(value, float)
        else html.escape(f"{value:,}" if isinstance(value, int) else str(value))
    )


def print_summary(summary: dict[str, Any]) -> None:
    """Rich tables on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title=f"job {summary['job']}", show_header=False)
    if summary.get("model_family"):
        head.add_row("model_family", str(summary["model_family"]))
    if not summary.get("reasoning_spans", True):
        head.add_row("reasoning spans", "off (--no-reasoning-spans): no reasoning share, no </think> rate")
    for key in (
        "rows",
        "conversations",
        "turns",
        "complete_conversations",
        "output_tokens",
        "prompt_tokens",
        "reasoning_tokens",
        "tool_call_rows",
        "over_2000",
        "over_5000",
    ):
        if summary.get(key) is not None:
            head.add_row(key, f"{summary[key]:,}")
    for key in ("truncation_rate", "think_end_rate"):
        if summary.get(key) is not None:
            head.add_row(key, f"{summary[key]:.1%}")
    head.add_row("tokens/s (overall)", f"{summary.get('tokens_per_s', 0.0):,.1f}")
    for name, value in prefix_rows(summary.get("prefix_cache")).items():
        head.add_row(name, value)
    console.print(head)
    for title, key in (("output length", "output_length"), ("reasoning share", "reasoning_share")):
        if not summary[key]:
            continue
        dist = Table(title=title)
        for name in summary[key]:
            dist.add_column(name, justify="right")
        dist.add_row(*(f"{v:,.2f}" for v in summary[key].values()))
        console.print(dist)
    counts = Table(title="datasets and finish reasons")
    counts.add_column("name")
    counts.add_column("rows", justify="right")
    for name, n in {**summary["datasets"], **{f"finish={k}": v for k, v in summary["finish_reasons"].items()}}.items():
        counts.add_row(name, f"{n:,}")
    console.print(counts)
    workers = Table(title="workers")
    for col in ("worker", "rows", "output tokens", "tokens/s"):
        workers.add_column(col, justify="right" if col != "worker" else "left")
    for name, w in (summary.get("workers") or {}).items():
        workers.add_row(name, f"{w['rows']:,}", f"{w['output_tokens']:,}", f"{w['tokens_per_s']:,.1f}")
    console.print(workers)
    for table in server_tables(summary):
        console.print(table)
    card = summary.get("card")
    if card:
        console.print(card_table(card))


def card_table(card: dict[str, Any]) -> Any:
    """Rich table: per dataset what was kept, dropped, cut or flagged, and what the job cost."""
    from rich.table import Table

    table = Table(title="data card (report --out writes card.md)")
    for col in ("dataset", "submitted", "stored", "dead", *FLAG_NAMES):
        table.add_column(col, justify="left" if col in ("dataset", "dead") else "right")
    for name, d in card["datasets"].items():
        dead = ", ".join(f"{k} {v}" for k, v in sorted(d["dead"].items())) or "0"
        flags = d.get("flags") or {}
        table.add_row(name, "?" if d["submitted"] is None else str(d["submitted"]), str(d["stored"]), dead,
                      *(str(flags.get(f, 0)) for f in FLAG_NAMES))  # fmt: skip
    cost = card["cost"]
    per_gpu = cost.get("output_tokens_per_s_per_gpu")
    usd = f", ${cost['usd']:,.2f}" if cost.get("usd") is not None else ""
    table.caption = f"GPU-hours {cost['gpu_hours']:.3f} (host-hours {cost['host_hours']:.3f}{usd})" + (
        f", {per_gpu:,.1f} output tokens/s per GPU" if per_gpu is not None else ""
    )
    return table


def server_tables(summary: dict[str, Any]) -> list[Any]:
    """Rich tables: each server configuration (version, launch arguments, workers, rows), the records that could
    not be read, and the speculative-decoding figures."""
    from rich.table import Table

    tables = []
    for server in summary.get("servers") or []:
        config = server.get("server_config") or "none"
        title = f"server {config}: SGLang {server.get('sglang_version') or '?'}, {server.get('rows', 0):,} rows"
        table = Table(title=title, show_header=False)
        if not server.get("workers"):
            why = "rows written before provenance was recorded" if config == "none" else "no record of it was found"
            table.add_row("record", why)
        for key in ("model_path", "weight_version"):
            if server.get(key) is not None:
                table.add_row(key, str(server[key]))
        for key, value in (server.get("highlights") or {}).items():
            if key not in ("model_path", "weight_version"):
                table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
        files = (server.get("model_config") or {}).get("files") or {}
        for name, digest in files.items():
            table.add_row(f"model {name}", digest)
        if server.get("model_config") and not (server.get("model_config") or {}).get("read"):
            table.add_row("model config", "not read by the workers (the server's model_path names the weights)")
        if server.get("launch_args"):
            table.add_row("launch arguments", f"{len(server['launch_args'])} recorded (--json prints them all)")
        for w in server.get("workers") or []:
            revision = (w.get("git_revision") or "?")[:12]
            software = f"thinkfleet {w.get('thinkfleet_version') or '?'} @ {revision}"
            seed = f"; random_seed {w['random_seed']}" if w.get("random_seed") is not None else ""
            table.add_row("worker", f"{w.get('worker')} on {w.get('host')} ({w.get('sglang_url')}{seed}; {software})")
        tables.append(table)
    for bad in summary.get("unreadable_provenance") or []:
        table = Table(title="unreadable provenance record", show_header=False)
        table.add_row(str(bad.get("file")), str(bad.get("error")))
        tables.append(table)
    spec = summary.get("speculative")
    if spec:
        table = Table(title="speculative decoding (acceptance)", show_header=False)
        table.add_row("rows", f"{spec['rows']:,}")
        if spec.get("accept_rate") is not None:
            table.add_row(
                "accept rate", f"{spec['accept_rate']:.1%} ({spec['accepted_tokens']:,} of {spec['draft_tokens']:,})"
            )
        if spec.get("accept_length") is not None:
            table.add_row("accept length", f"{spec['accept_length']:.2f} tokens per verify step")
        for name, value in (spec.get("row_accept_rate") or {}).items():
            table.add_row(f"row accept rate {name}", f"{value:.1%}")
        tables.append(table)
    return tables
