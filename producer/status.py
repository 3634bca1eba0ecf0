"""``producer status`` / ``producer wait``: progress of a job from what workers write to Redis.

Counts come from where each prompt really is (``thinkfleet.state.invariant.account``), so they stay right
through redeliveries: done = the ``done`` SET, dead = the ``dead`` HASH, running = delivered (kombu's
unacked hash, a worker's transit list, or claimed by a live worker), queued = a message on the queue, and
**unaccounted** = submitted but in none of those places — a lost prompt, which nothing will ever store
(before this count existed, a loss showed as "queued" forever over an empty queue). The queue is scanned
by a Lua script that returns only task ids, so a large queue costs Redis time, not network.

With a non-Redis broker (RabbitMQ) queued and running messages cannot be seen: running = live claims,
queued = the rest, and ``unaccounted`` is None.
Rates come from the timeline ZSET workers append to at every group commit ("ts:rows:tokens").
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.job import JobRecord
from thinkfleet.broker.queues import queue_length
from thinkfleet.settings import Settings
from thinkfleet.state.invariant import NotObservable, account, live_claims

#: Unaccounted prompt ids listed in the status (the count is always complete).
UNACCOUNTED_IDS = 20
#: Per-prompt states, in the order they are shown.
STATES = ("total", "queued", "running", "done", "dead", "unaccounted")

#: Window of the "current" rates (and so of the ETA).
DEFAULT_WINDOW_S = 60.0


@dataclass
class StatusReader:
    """Reads a job's status; caches the prompt → dataset map (it only changes on submit)."""

    client: redis.Redis
    settings: Settings
    job: str
    window_s: float = DEFAULT_WINDOW_S
    _dataset_of: dict[str, str] | None = None
    _dataset_of_count: int = -1
    _last: tuple[float, dict[str, int]] | None = field(default=None, repr=False)

    def dataset_of(self) -> dict[str, str]:
        key = self.settings.keys.prompt_dataset(self.job)
        count = self.client.hlen(key)
        if self._dataset_of is None or count != self._dataset_of_count:
            raw = self.client.hgetall(key)
            self._dataset_of = {k.decode(): v.decode() for k, v in raw.items()}
            self._dataset_of_count = count
        return self._dataset_of

    def read(self) -> dict[str, Any]:
        keys, job, r = self.settings.keys, self.job, self.client
        record = JobRecord.load(r, keys, job)
        now = time.time()
        if record is None:
            return {"job": job, "exists": False, "finished": False, "at": now}
        dataset_of = self.dataset_of()
        submitted = set(dataset_of)
        try:
            acc = account(r, self.settings, job, submitted=submitted)
            state_of, unaccounted_ids = acc.state_of, sorted(acc.unaccounted)
            observable = True
        except NotObservable:
            # RabbitMQ: its queue is invisible. Live claims are running, the rest is presumed queued.
            done = {m.decode() for m in r.smembers(keys.done(job))}
            dead = {k.decode() for k in r.hkeys(keys.dead(job))}
            running = live_claims(r, self.settings, job)

            def state_of(pid: str) -> str:
                return "done" if pid in done else "dead" if pid in dead else "running" if pid in running else "queued"

            unaccounted_ids, observable = [], False
        datasets: dict[str, dict[str, int]] = {}
        for pid, ds in dataset_of.items():
            d = datasets.setdefault(ds, dict.fromkeys(STATES, 0))
            d["total"] += 1
            d[state_of(pid)] += 1
        totals: dict[str, Any] = {s: sum(d[s] for d in datasets.values()) for s in STATES}
        if not observable:
            totals["unaccounted"] = None
            for d in datasets.values():
                d.pop("unaccounted")
        counters = {k.decode(): int(float(v)) for k, v in r.hgetall(keys.counters(job)).items()}
        workers = {k.decode(): int(float(v)) for k, v in r.hgetall(keys.worker_counters(job)).items()}
        rates = self._rates(now, counters, workers)
        mean_out = counters.get("output_tokens", 0) / counters["done"] if counters.get("done") else None
        remaining = totals["total"] - totals["done"] - totals["dead"]
        tok_s = rates["output_tokens_per_s"]
        eta = remaining * mean_out / tok_s if remaining and mean_out and tok_s else (0.0 if not remaining else None)
        alarm_raw = r.get(keys.alarm(job))
        raw_state = r.get(keys.job_state(job))  # producer pause/cancel (thinkfleet/state/lifecycle.py)
        state = raw_state.decode() if raw_state else ("finished" if remaining == 0 and totals["total"] else "active")
        return {
            "job": job,
            "exists": True,
            "at": now,
            "state": state,
            "priority": record.priority,
            "parked": int(r.llen(keys.parked(job))),
            **totals,
            "remaining": remaining,
            "finished": remaining == 0 and totals["total"] > 0,
            "unaccounted_ids": unaccounted_ids[:UNACCOUNTED_IDS],
            "invariant_observable": observable,
            "datasets": dict(sorted(datasets.items())),
            "rates": rates,
            "workers": rates.pop("workers"),
            "mean_output_tokens": None if mean_out is None else round(mean_out, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "alarm": _json_or_text(alarm_raw),
            "queue_length": queue_length(r, self.settings.queue),
            "output_tokens": counters.get("output_tokens", 0),
            "truncated": counters.get("truncated", 0),
            "missing_think_end": counters.get("missing_think_end", 0),
            "nondeterministic_seeds": counters.get("nondeterministic_seeds", 0),  # seeded, server ignores seeds
            # runs of paused-past-their-lease workers refused (thinkfleet/state/ledger.py): nothing of theirs stored
            "fenced": counters.get("fenced", 0),
            "max_new_tokens": record.max_new_tokens,
            "job_file": record.job_file,  # the job file as it ran (producer submit job.yaml), else null
            "clock_warnings": clock_warnings(r, self.settings),
            "clock_skew_warn_s": self.settings.clock_skew_warn_s,
            **self._turns(counters),
        }

    def _turns(self, counters: dict[str, int]) -> dict[str, Any]:
        """--turns all: ``conversations`` {total, complete, in_progress, cut_at_tool, chain_ended, dead} and
        ``turns`` {enqueued, done}, from the job hash's ``turns`` field, the ``turns_enqueued`` counter (later
        turns the workers enqueued), the done set, the dead letters and the answers hash. {} for other jobs."""
        from thinkfleet.turns import (
            TURNS_FIELD,
            answers_key,
            conversations_key,
            regenerates_all_turns,
            split_turn_id,
            turn_id,
            turns_meta,
        )

        keys, job, r = self.settings.keys, self.job, self.client
        meta = turns_meta(r.hget(keys.job(job), TURNS_FIELD))
        if not regenerates_all_turns(meta):
            return {}
        done = {m.decode() for m in r.smembers(keys.done(job))}
        dead = {k.decode() for k in r.hkeys(keys.dead(job))}
        ended: set[str] = set()
        for pid, raw in r.hscan_iter(answers_key(keys, job), count=1000):
            if b"chain_end" in raw and "chain_end" in (_json_or_text(raw) or {}):
                parts = split_turn_id(pid.decode())
                if parts is not None:
                    ended.add(parts[0])
        total = complete = chain_ended = dead_convs = 0
        for conv, raw in r.hscan_iter(conversations_key(keys, job), count=1000):
            total += 1
            c, count = conv.decode(), int(json.loads(raw)["turn_count"])
            if turn_id(c, count - 1) in done:
                complete += 1
            elif c in ended:
                chain_ended += 1
            elif any(turn_id(c, t) in dead for t in range(count)):
                dead_convs += 1
        total = max(total, int(meta.get("conversations") or 0))
        turns_done = sum(1 for pid in done if split_turn_id(pid) is not None)
        return {
            "conversations": {
                "total": total,
                "complete": complete,
                "in_progress": total - complete - chain_ended - dead_convs,
                "cut_at_tool": int(meta.get("cut_at_tool") or 0),
                "chain_ended": chain_ended,
                "dead": dead_convs,
            },
            "turns": {
                "planned": int(meta.get("turns") or 0),
                "enqueued": total + counters.get("turns_enqueued", 0),
                "done": turns_done,
            },
        }

    def _rates(self, now: float, counters: dict[str, int], workers: dict[str, int]) -> dict[str, Any]:
        tl = self.settings.keys.timeline(self.job)
        first = self.client.zrange(tl, 0, 0, withscores=True)
        recent = self.client.zrangebyscore(tl, now - self.window_s, "+inf")
        rows = tokens = 0
        for member in recent:
            _ts, n, t = member.decode().rsplit(":", 2)
            rows += int(n)
            tokens += int(t)
        started = first[0][1] if first else None
        span = min(self.window_s, now - started) if started else 0.0
        elapsed = now - started if started else 0.0
        out: dict[str, Any] = {
            "window_s": self.window_s,
            "prompts_per_s": round(rows / span, 3) if span > 0 else 0.0,
            "output_tokens_per_s": round(tokens / span, 1) if span > 0 else 0.0,
            "overall_prompts_per_s": round(counters.get("done", 0) / elapsed, 3) if elapsed > 0 else 0.0,
            "overall_output_tokens_per_s": round(counters.get("output_tokens", 0) / elapsed, 1) if elapsed > 0 else 0.0,
            "elapsed_s": round(elapsed, 1),
        }
        # Per worker: the average since the job started, and the rate since the previous read (watch).
        previous = self._last
        self._last = (now, dict(workers))
        per_worker = {}
        for name, tok in sorted(workers.items()):
            entry: dict[str, Any] = {
                "output_tokens": tok,
                "avg_tokens_per_s": round(tok / elapsed, 1) if elapsed > 0 else 0.0,
            }
            if previous is not None and now > previous[0]:
                entry["tokens_per_s"] = round((tok - previous[1].get(name, 0)) / (now - previous[0]), 1)
            per_worker[name] = entry
        out["workers"] = per_worker
        return out


def clock_warnings(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """Live workers (their heartbeats, workers/lease.py) whose host clock is off Redis's by more than
    ``clock_skew_warn_s``: {worker, host, pid, offset_s} (offset = host − Redis, measured at each beat)."""
    prefix = settings.keys.heartbeat("")
    out = []
    for raw_key in client.scan_iter(match=f"{_glob_escape(prefix)}*", count=1000):
        key = raw_key.decode(errors="replace")
        beat = _json_or_text(client.get(raw_key))
        if not isinstance(beat, dict):
            continue
        offset = beat.get("clock_offset_s")
        if isinstance(offset, int | float) and abs(offset) > settings.clock_skew_warn_s:
            worker = key[len(prefix) :]
            out.append({"worker": worker, "host": beat.get("host"), "pid": beat.get("pid"), "offset_s": offset})
    return sorted(out, key=lambda w: str(w["worker"]))


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _json_or_text(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def confirm_stored(settings: Settings, job: str, done: set[str]) -> set[str]:
    """Prompt ids Redis calls done that storage does not hold (empty = consistent)."""
    from producer.state import stored_prompt_ids

    try:
        import storage.reader  # noqa: F401
    except ImportError:
        return set()
    return done - stored_prompt_ids(settings, job)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
