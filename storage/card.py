"""The data card: what a trainer reads before training on a job — what was kept, dropped, cut or broken, and
what it cost (``producer report JOB --out DIR`` writes ``card.md``; ``--json`` carries the same facts as ``card``;
the ``hf`` export puts it in its ``README.md``).

Every figure comes from the committed rows (storage), the job record and dead letters (Redis, when it answers) and
the servers' provenance records (``{job}/_provenance/``):

- **prompts**, per dataset: submitted, stored, dead-lettered by class, truncated and each quality flag
  (storage/flags.py; rows of parts older than the flag columns are counted ``unknown``).
- **tokens**: in, out, the reasoning share.
- **time and cost**: the job's wall time (first to last stored row); per server (a worker host's SGLang URL) its
  active time — first to last row of the workers it served — times its GPUs: tensor × pipeline × data parallel
  from its recorded launch arguments (``tp_size``, ``pp_size``, ``dp_size``; data-parallel attention shares the
  tensor-parallel GPUs), or ``--gpus-per-host`` (which also stands in for a server with no record); host-hours
  and **GPU-hours** are their sums, **output tokens/s per GPU** the output tokens over the GPU-seconds, the
  **cost** GPU-hours × ``--usd-per-gpu-hour``.
- **projection**: at the measured output tokens/s per server, how long this job — and the seed's job (88,088
  prompts × 1,416 output tokens on average, 57 hours on one server) — takes on 1 host and on N.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa

from storage.flags import FLAG_NAMES, TRUNCATED
from storage.schema import COMPLETION_TOKENS, CREATED_AT, DATASET, FINISH_REASON, WORKER

#: The seed's job (MISSION.md): prompts, mean output tokens, and hours on one SGLang server.
SEED_PROMPTS = 88_088
SEED_MEAN_OUTPUT_TOKENS = 1_416
SEED_HOURS_ONE_SERVER = 57.0
#: Host counts the projection is printed for.
PROJECTION_HOSTS = (1, 8, 32)


def server_gpus(launch_args: dict[str, Any]) -> int | None:
    """GPUs one SGLang server with these launch arguments runs on (None: the record does not say)."""
    if not launch_args or launch_args.get("tp_size") is None:
        return None
    tp = int(launch_args.get("tp_size") or 1)
    pp = int(launch_args.get("pp_size") or 1)
    dp = int(launch_args.get("dp_size") or 1)
    if launch_args.get("enable_dp_attention"):
        dp = 1  # data-parallel attention runs inside the tensor-parallel group's GPUs
    return tp * pp * dp


def card_facts(
    summary: dict[str, Any],
    table: pa.Table,
    state: Any,
    *,
    gpus_per_host: int | None = None,
    usd_per_gpu_hour: float | None = None,
) -> dict[str, Any]:
    """The card's facts from the report's ``summary`` and ``table`` (its scalar columns and the flag columns),
    and ``state`` (storage.jobstate.JobState: submitted and dead letters; Redis may not have answered)."""
    return {
        "job": summary["job"],
        "model_family": summary.get("model_family"),
        "datasets": _datasets(table, state),
        "tokens": {
            "prompt": summary.get("prompt_tokens", 0),
            "output": summary.get("output_tokens", 0),
            "reasoning": summary.get("reasoning_tokens"),
            "reasoning_share": (
                summary["reasoning_tokens"] / summary["output_tokens"]
                if summary.get("reasoning_tokens") is not None and summary.get("output_tokens")
                else None
            ),
        },
        "cost": _cost(summary, table, gpus_per_host, usd_per_gpu_hour),
        "speculative": summary.get("speculative"),
        "redis_answered": bool(getattr(state, "redis_ok", False)),
    }


def _datasets(table: pa.Table, state: Any) -> dict[str, dict[str, Any]]:
    names = table[DATASET].cast(pa.string()).to_numpy(zero_copy_only=False) if table.num_rows else np.array([])
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"submitted": None, "stored": 0, "dead": {}})
    if getattr(state, "redis_ok", False):
        for dataset in state.prompt_dataset.values():
            entry = out[dataset]
            entry["submitted"] = (entry["submitted"] or 0) + 1
        for pid, record in state.dead.items():
            dead = out[state.prompt_dataset.get(pid, "?")]["dead"]
            cls = str(record.get("error_class") or "unknown")
            dead[cls] = dead.get(cls, 0) + 1
    finish = table[FINISH_REASON].to_numpy(zero_copy_only=False) if table.num_rows else np.array([])
    for name in sorted(set(names.tolist())):
        mine = names == name
        entry = out[name]
        entry["stored"] = int(mine.sum())
        flags: dict[str, int] = {TRUNCATED: int((mine & (finish != "stop")).sum())}
        unknown = 0
        for flag in FLAG_NAMES[1:]:
            column = table[flag] if flag in table.column_names else pa.nulls(table.num_rows, pa.bool_())
            valid = column.is_valid().to_numpy(zero_copy_only=False)
            flags[flag] = int((mine & column.fill_null(False).to_numpy(zero_copy_only=False)).sum())
            unknown = max(unknown, int((mine & ~valid).sum()))
        entry["flags"] = flags
        if unknown:
            entry["flags_unknown_rows"] = unknown  # rows of parts written before the flag columns
    return dict(sorted(out.items()))


def _cost(
    summary: dict[str, Any], table: pa.Table, gpus_per_host: int | None, usd_per_gpu_hour: float | None
) -> dict[str, Any]:
    """Wall time, host- and GPU-hours, output tokens/s per GPU, cost and the projection (module docstring)."""
    if table.num_rows == 0:
        return {"wall_s": 0.0, "servers": [], "host_hours": 0.0, "gpu_hours": 0.0}
    t = table[CREATED_AT].cast(pa.int64()).to_numpy() / 1e6
    out_len = table[COMPLETION_TOKENS].to_numpy().astype(np.int64)
    workers = np.array(table[WORKER].to_pylist(), dtype=object)
    where: dict[str, tuple[str, int | None]] = {}  # worker → (server key, its GPUs)
    for server in summary.get("servers") or []:
        gpus = server_gpus(server.get("launch_args") or {})
        for w in server.get("workers") or []:
            where[str(w.get("worker"))] = (f"{w.get('host')} {w.get('sglang_url')}", gpus)
    servers: dict[str, dict[str, Any]] = {}
    for name in sorted(set(workers.tolist())):
        key, gpus = where.get(name, (f"worker {name}", None))
        mine = workers == name
        entry = servers.setdefault(key, {"server": key, "gpus": gpus, "workers": [], "first": t[mine].min(),
                                         "last": t[mine].max(), "output_tokens": 0})  # fmt: skip
        entry["workers"].append(name)
        entry["first"], entry["last"] = min(entry["first"], t[mine].min()), max(entry["last"], t[mine].max())
        entry["output_tokens"] += int(out_len[mine].sum())
    assumed = False
    for entry in servers.values():
        if gpus_per_host is not None:
            entry["gpus"] = gpus_per_host
        elif entry["gpus"] is None:
            entry["gpus"], assumed = 1, True
        entry["active_s"] = float(entry.pop("last") - entry.pop("first"))
    host_s = sum(e["active_s"] for e in servers.values())
    gpu_s = sum(e["active_s"] * e["gpus"] for e in servers.values())
    tokens = int(out_len.sum())
    # The rate of one server: each server's tokens over its active time, averaged over the servers.
    rates = [e["output_tokens"] / e["active_s"] for e in servers.values() if e["active_s"] > 0]
    per_server = float(np.mean(rates)) if rates else None
    seed_tokens = SEED_PROMPTS * SEED_MEAN_OUTPUT_TOKENS
    return {
        "wall_s": float(t.max() - t.min()),
        "servers": list(servers.values()),
        "gpus_assumed": assumed,  # a server with no record of its launch arguments and no --gpus-per-host: 1 GPU
        "host_hours": host_s / 3600,
        "gpu_hours": gpu_s / 3600,
        "output_tokens_per_s_per_gpu": tokens / gpu_s if gpu_s > 0 else None,
        "usd_per_gpu_hour": usd_per_gpu_hour,
        "usd": gpu_s / 3600 * usd_per_gpu_hour if usd_per_gpu_hour is not None else None,
        "output_tokens_per_s_per_server": per_server,
        "projection_hours": {
            str(n): {
                "this_job": tokens / per_server / n / 3600 if per_server else None,
                "seed_job": seed_tokens / per_server / n / 3600 if per_server else None,
                "seed_job_measured": SEED_HOURS_ONE_SERVER / n,
            }
            for n in PROJECTION_HOSTS
        },
    }


def card_markdown(facts: dict[str, Any], plots: list[str] | None = None) -> str:
    """The card as Markdown (the ``hf`` export's README body, ``card.md``)."""
    lines = [f"# Data card: thinkfleet job `{facts['job']}`", ""]
    if facts.get("model_family"):
        lines += [f"Model family: `{facts['model_family']}`.", ""]
    if not facts.get("redis_answered"):
        lines += ["Redis did not answer: submitted and dead-lettered counts are unknown (shown as ?).", ""]
    lines += ["## Prompts", "", "| dataset | submitted | stored | dead | " + " | ".join(FLAG_NAMES) + " |"]
    lines += ["|---" * (4 + len(FLAG_NAMES)) + "|"]
    for name, d in facts["datasets"].items():
        dead = ", ".join(f"{k} {v}" for k, v in sorted(d["dead"].items())) or "0"
        flags = d.get("flags") or {}
        unknown = f" (+{d['flags_unknown_rows']} unknown)" if d.get("flags_unknown_rows") else ""
        cells = [f"{flags.get(f, 0)}{unknown if f != TRUNCATED else ''}" for f in FLAG_NAMES]
        submitted = "?" if d["submitted"] is None else str(d["submitted"])
        lines.append(f"| {name} | {submitted} | {d['stored']} | {dead} | " + " | ".join(cells) + " |")
    lines += ["", "Flags: docs/storage.md#quality-flags; drop them with `producer export --drop-flag …`.", ""]
    tok = facts["tokens"]
    share = f", reasoning {tok['reasoning']:,} ({tok['reasoning_share']:.1%})" if tok.get("reasoning_share") else ""
    lines += ["## Tokens", "", f"Prompt {tok['prompt']:,}, output {tok['output']:,}{share}.", ""]
    cost = facts["cost"]
    lines += ["## Time and cost", ""]
    lines.append(f"- wall time (first to last stored row): {cost['wall_s'] / 3600:.3f} h")
    lines.append(f"- host-hours: {cost['host_hours']:.3f}; GPU-hours: {cost['gpu_hours']:.3f}")
    for s in cost["servers"]:
        lines.append(f"  - {s['server']}: {s['gpus']} GPUs, active {s['active_s']:.0f} s, {s['output_tokens']:,} "
                     f"output tokens ({', '.join(s['workers'])})")  # fmt: skip
    if cost.get("gpus_assumed"):
        lines.append("  - a server with no recorded launch arguments is counted as 1 GPU (give --gpus-per-host)")
    if cost.get("output_tokens_per_s_per_gpu") is not None:
        lines.append(f"- output tokens/s per GPU: {cost['output_tokens_per_s_per_gpu']:,.1f}")
    if cost.get("usd") is not None:
        lines.append(f"- cost at ${cost['usd_per_gpu_hour']:,.2f}/GPU-hour: ${cost['usd']:,.2f}")
    if cost.get("output_tokens_per_s_per_server"):
        lines += ["", f"At {cost['output_tokens_per_s_per_server']:,.1f} output tokens/s per server:", ""]
        lines += ["| hosts | this job (h) | the seed's job at this rate (h) | the seed's job as measured (h) |"]
        lines += ["|---|---|---|---|"]
        for n, p in cost["projection_hours"].items():
            lines.append(f"| {n} | {p['this_job']:.3f} | {p['seed_job']:.1f} | {p['seed_job_measured']:.1f} |")
    spec = facts.get("speculative")
    if spec and spec.get("accept_rate") is not None:
        lines += ["", "## Speculative decoding", ""]
        lines.append(f"Accept rate {spec['accept_rate']:.1%}, accept length {spec.get('accept_length') or 0:.2f} "
                     f"over {spec['rows']:,} rows.")  # fmt: skip
    if plots:
        lines += ["", "## Plots", "", *(f"![{p}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"
