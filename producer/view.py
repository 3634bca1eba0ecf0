"""Rich renderings of a submit report and of a job's status (the CLI prints these)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from producer.status import format_duration

if TYPE_CHECKING:  # producer.report reads inputs (Arrow): status and wait do not need it
    from producer.report import SubmitReport


def submit_report(report: SubmitReport, hosts: int, server_tok_s: float, mean_output_tokens: float) -> Group:
    table = Table(title=f"job {report.job}" + (" — dry run, nothing enqueued" if report.dry_run else ""))
    for col in (
        "dataset",
        "rows",
        "prompts",
        "enqueued",
        "already done",
        "queued/running",
        "dead",
        "skipped",
        "prompt tokens",
    ):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for name, d in report.datasets.items():
        table.add_row(
            name,
            f"{d.rows:,}",
            f"{d.prompts:,}",
            f"{d.enqueued:,}",
            f"{d.already_done:,}",
            f"{d.already_queued:,}",
            f"{d.dead:,}",
            f"{d.skipped:,}",
            f"{d.prompt_tokens:,}",
        )
    parts: list[Any] = [table]
    s = report.lengths
    if s.get("count"):
        parts.append(
            Text(
                f"prompt length (tokens): min {s['min']:,}  median {s['median']:,.0f}  mean {s['mean']:,.1f}"
                f"  p99 {s['p99']:,}  max {s['max']:,}"
            )
        )
    verb = "would enqueue" if report.dry_run else "enqueued"
    parts.append(
        Text(
            f"{verb} {report.enqueued:,} prompts ({report.prompt_tokens_enqueued:,} prompt tokens) "
            f"in {report.elapsed_s:.1f} s; Redis ≈ {report.estimated_redis_bytes / 2**20:,.1f} MiB"
        )
    )
    if report.resumed:
        parts.append(
            Text(
                f"{report.resumed:,} conversation(s) resume from their stored turns: workers finalize those again "
                "from their parts (answers, next turns) and go on where each stopped"
            )
        )
    if report.dry_run:
        parts.append(
            Text(
                f"projected wall time: {report.projected_wall_s / 3600:,.1f} h on {hosts} host(s) at "
                f"{server_tok_s:,.0f} output tokens/s each, {mean_output_tokens:,.0f} tokens per answer"
            )
        )
    if report.problems:
        parts.append(Text(f"skipped {len(report.problems)} row(s) (recorded in the job record):", style="yellow"))
        parts.extend(Text(f"  {p}", style="yellow") for p in report.problems[:10])
    for w in report.warnings:
        parts.append(Panel(Text(w, style="bold red"), title="WARNING", border_style="red"))
    return Group(*parts)


def status_view(st: dict[str, Any]) -> Group:
    if not st.get("exists"):
        return Group(
            Text(
                f"job {st['job']!r} has no record in Redis (never submitted, or Redis lost it: re-run producer submit)",
                style="bold red",
            )
        )
    parts: list[Any] = []
    if st.get("alarm") is not None:
        parts.append(
            Panel(
                Text(
                    f"REASONING ALARM: rows lack </think> — the seed's bug?\n{st['alarm']}", style="bold white on red"
                ),
                border_style="red",
            )
        )
    if st.get("flag_alarm") is not None:  # producer/quality_live.py
        parts.append(
            Panel(Text(f"FLAG ALARM: {st['flag_alarm']['message']}", style="bold white on red"), border_style="red")
        )
    if st.get("nondeterministic_seeds"):
        parts.append(
            Text(
                "sampling_seed is set but SGLang runs without --enable-deterministic-inference: "
                "seeds are ignored, rows are not reproducible",
                style="bold yellow",
            )
        )
    if st.get("fenced"):
        parts.append(
            Text(
                f"{st['fenced']:,} run(s) fenced: a worker paused past its lease came back after another took its "
                "prompts over; nothing of theirs was counted (a worker that stalls that long: check its host)",
                style="yellow",
            )
        )
    if st.get("stale_generation"):
        parts.append(
            Text(
                f"{st['stale_generation']:,} message(s) of an earlier generation of this job (before a purge and a new "
                "submit) skipped by workers: never run with the new record; the new submit enqueued their prompts",
                style="yellow",
            )
        )
    for g in st.get("image_store_gates") or ():  # producer/image_gates.py
        parts.append(
            Text(
                f"worker {g['worker']} (host {g.get('host') or '?'}) cannot read the image store {g['store']}: "
                f"{g.get('reason')}; its image prompts are handed back there (another host runs them, nothing is "
                "dead-lettered): mount the store at that path (or set THINKFLEET_IMAGE_STORE_MAP) or fix permissions",
                style="bold yellow",
            )
        )
    for w in st.get("stalled_workers") or ():  # producer/stalls.py, workers/stall.py
        parts.append(Text(stalled_line(w), style="bold red"))
    for w in st.get("clock_warnings") or ():
        offset = float(w["offset_s"])
        parts.append(
            Text(
                f"worker {w['worker']} (host {w.get('host') or '?'}, pid {w.get('pid') or '?'}): its clock is "
                f"{abs(offset):,.1f} s {'ahead of' if offset > 0 else 'behind'} Redis's (more than "
                f"{float(st.get('clock_skew_warn_s') or 0):.0f} s); leases and visibility run on Redis time, but "
                "fix that host's clock (NTP): the timestamps it writes are off by as much",
                style="bold yellow",
            )
        )
    table = Table(title=f"job {st['job']}")
    states = ("total", "queued", "running", "done", "dead", "unaccounted")
    for col in ("dataset", "progress", *states):
        table.add_column(col, justify="left" if col in ("dataset", "progress") else "right")

    def cells(d: dict[str, Any], bold: str = "") -> list[str]:
        out = []
        for k in states:
            value = d.get(k)
            if value is None:
                out.append("—")  # not observable (RabbitMQ broker)
            elif k == "unaccounted" and value:
                out.append(f"[bold red]{value:,}")
            else:
                out.append(f"{bold}{value:,}")
        return out

    for name, d in st["datasets"].items():
        finished = d["done"] + d["dead"]
        table.add_row(name, ProgressBar(total=max(1, d["total"]), completed=finished, width=30), *cells(d))
    table.add_row(
        "[bold]all",
        ProgressBar(total=max(1, st["total"]), completed=st["done"] + st["dead"], width=30),
        *cells(st, "[bold]"),
    )
    parts.append(table)
    for name, flags in (st.get("quality_flags") or {}).items():  # rows flagged so far (producer/quality_live.py)
        if any(flags.values()):
            shown = ", ".join(f"{flag.replace('_', ' ')} {n:,}" for flag, n in flags.items() if n)
            parts.append(Text(f"{name}: flagged so far — {shown} (docs/storage.md#quality-flags)", style="dim"))
    if st.get("unaccounted"):
        ids = st.get("unaccounted_ids") or []
        more = st["unaccounted"] - len(ids)
        parts.append(
            Panel(
                Text(
                    f"{st['unaccounted']:,} prompt(s) are in no place: not stored, not dead-lettered, not on the "
                    f"queue, not delivered to a live worker. Nothing will run them; `producer submit` again "
                    f"re-enqueues them.\n" + ", ".join(ids) + (f" … and {more:,} more" if more > 0 else ""),
                    style="bold red",
                ),
                title="UNACCOUNTED",
                border_style="red",
            )
        )
    if st.get("mode") == "counters" and st.get("unaccounted") is None and st.get("invariant_observable"):
        parts.append(Text(_check_line(st.get("checked")), style="dim"))
    if st.get("conversations"):
        c, t = st["conversations"], st["turns"]
        parts.append(
            Text(
                f"conversations (--turns all): {_n(c['complete'])}/{c['total']:,} complete, {_n(c['in_progress'])} "
                f"in progress, {_n(c['chain_ended'])} ended with a recorded reason"
                + (f" ({', '.join(f'{k} {v:,}' for k, v in c['ends'].items())})" if c.get("ends") else "")
                + f", {_n(c.get('dead', 0))} stopped at a dead turn, {c['cut_at_tool']:,} cut at a dataset tool call"
                + (f", {c['tool_errors']:,} tool errors" if "tool_errors" in c else "")
                + f"   turns: {t['done']:,} done of "
                f"{t['enqueued']:,} enqueued ({t.get('planned', 0):,} planned)"
            )
        )
    if st.get("prefix_cache"):
        parts.append(Text(prefix_line(st["prefix_cache"])))
    if st.get("conversations") and st["conversations"].get("stranded"):
        c = st["conversations"]
        parts.append(
            Panel(
                Text(
                    f"{c['stranded']:,} conversation(s) stopped without a recorded end: the last answer goes on to a "
                    f"prompt nobody enqueued or dead-lettered, and nothing will run it (producer verify: MISSING "
                    f"TURNS).\n" + ", ".join(c.get("stranded_ids") or []),
                    style="bold red",
                ),
                title="STRANDED CONVERSATIONS",
                border_style="red",
            )
        )
    r = st["rates"]
    parts.append(
        Text(
            f"now ({r['window_s']:.0f} s): {r['prompts_per_s']:.2f} prompts/s, "
            f"{r['output_tokens_per_s']:,.0f} tokens/s   "
            f"overall: {r['overall_prompts_per_s']:.2f} prompts/s, {r['overall_output_tokens_per_s']:,.0f} tokens/s   "
            f"mean answer {st['mean_output_tokens'] or 0:,.0f} tokens   ETA {format_duration(st['eta_s'])}   "
            f"queue length (all jobs) {st['queue_length']:,}"
        )
    )
    if st["workers"]:
        wt = Table(title="workers")
        for col in ("worker", "output tokens", "avg tokens/s", "tokens/s now"):
            wt.add_column(col, justify="left" if col == "worker" else "right")
        for name, w in st["workers"].items():
            now = w.get("tokens_per_s")
            wt.add_row(
                name, f"{w['output_tokens']:,}", f"{w['avg_tokens_per_s']:,.0f}", "—" if now is None else f"{now:,.0f}"
            )
        parts.append(wt)
    if st.get("inflight_bounds"):  # each host's in-flight bound (workers/adaptive.py) and why it last moved
        bt = Table(title="in-flight bound per worker")
        for col in ("worker", "host", "mode", "bound / cap", "why it last moved"):
            bt.add_column(col, justify="right" if col == "bound / cap" else "left")
        for name, b in st["inflight_bounds"].items():
            bound = f"{b.get('bound')} / {b.get('cap')}"
            bt.add_row(name, str(b.get("host") or "?"), str(b.get("mode")), bound, str(b.get("reason") or ""))
        parts.append(bt)
    if st.get("finished"):
        parts.append(Text("finished: every prompt is stored or dead-lettered", style="bold green"))
    return Group(*parts)


def _n(value: int | None) -> str:
    """A count, or — where only a full scan knows it (``status --deep``)."""
    return "—" if value is None else f"{value:,}"


def _check_line(checked: dict[str, Any] | None) -> str:
    """What a counters read says about prompts in no place: the last full check's verdict."""
    head = "counted from counters (O(1) of the queue); where pending prompts are is scanned by --deep"
    if not checked:
        return head + " — no full check yet"
    lost = checked.get("unaccounted")
    verdict = "none unaccounted" if not lost else f"{lost:,} unaccounted"
    return f"{head} — last full check {format_duration(checked.get('age_s'))} ago: {verdict}"


def stalled_line(w: dict[str, Any]) -> str:
    """One stalled worker (producer/stalls.py): who, why, and what it holds."""
    held = f"{w.get('held') or 0} message(s) held, {w.get('commit_waiting') or 0} row(s) waiting to commit"
    return (
        f"worker {w['worker']} (host {w.get('host') or '?'}) STALLED: {w['reason']} ({held}; no progress for "
        f"{float(w.get('progress_age_s') or 0):,.0f} s) — see its log; a stuck commit ends the worker by itself "
        "(THINKFLEET_COMMIT_STUCK_EXIT_S), a storage outage waits behind its gate"
    )


def status_line(st: dict[str, Any]) -> str:
    """One plain line of a job's status, for ``status --watch`` into a file or a pipe (no live view there)."""
    if not st.get("exists"):
        return f"job {st['job']}: no record in Redis"
    r = st["rates"]
    lost = st.get("unaccounted")
    return (
        f"{time.strftime('%H:%M:%S', time.localtime(st['at']))} job {st['job']} {st.get('state', '')}: "
        f"{st['done'] + st['dead']:,}/{st['total']:,} finished (done {st['done']:,}, dead {st['dead']:,}, "
        f"running {st['running']:,}, queued {st['queued']:,}, unaccounted {_n(lost) if lost is not None else '—'}) "
        f"{r['prompts_per_s']:.2f} prompts/s {r['output_tokens_per_s']:,.0f} tokens/s "
        f"ETA {format_duration(st['eta_s'])}"
        + "".join(f" | {stalled_line(w)}" for w in st.get("stalled_workers") or ())
    )


def prefix_line(p: dict[str, Any]) -> str:
    """One line of a job's later-turn prefix cache (producer status ``prefix_cache``)."""
    rate = "n/a" if p.get("hit_rate") is None else f"{100 * p['hit_rate']:.1f}%"
    return (
        f"prefix cache (later turns): hit rate {rate} — {p['cached_tokens']:,} of {p['reusable_tokens']:,} reusable "
        f"prompt tokens cached, over {p['turns']:,} turns"
    )
