"""``producer status`` / ``producer wait``: progress of a job from what workers write to Redis.

Two ways to count, one answer:

- **counters** (the default, O(1) of the queue and of the job): total, done and dead are the sizes of the job's
  sets and its datasets' counters, which every transition keeps (:mod:`thinkfleet.state.counters`); running =
  prompts claimed by a live worker (the claims hash: as many as the fleet has in flight); queued = the rest.
  Where a pending prompt *is* — on the queue, or nowhere (lost) — is not known here: ``unaccounted`` is 0 once
  every prompt is done or dead, else null, and ``checked`` carries the verdict of the last full check.
- **deep** (``--deep``, the periodic check of ``wait``/``--watch``, and whenever the broker holds at most
  :data:`AUTO_DEEP_MESSAGES` messages and the job :data:`AUTO_DEEP_PROMPTS` prompts, where the scan costs a few
  milliseconds): every prompt is looked for where it really is (``thinkfleet.state.invariant.account``): done =
  the ``done`` SET, dead = the ``dead`` HASH, running = delivered (kombu's unacked hash, a worker's transit
  list, or claimed by a live worker), queued = a message on the queue, and **unaccounted** = in none of those
  places — a lost prompt, which nothing will ever store. The queue is scanned by a Lua script that returns only
  task ids. A deep read also checks the counters against the sets (repairing drift) and records its verdict.

With a non-Redis broker (RabbitMQ) queued and running messages cannot be seen: running = live claims,
queued = the rest, and ``unaccounted`` is None.
Rates come from the timeline ZSET workers append to at every group commit ("ts:rows:tokens").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.bounds import inflight_bounds
from producer.chain_state import TOOL_ERRORS_FIELD, ended_counts, keeps_chain_state, waiting_states
from producer.clocks import clock_warnings
from producer.image_gates import image_store_gates
from producer.job import JobRecord
from producer.quality_live import flag_alarm, flags_so_far, job_flags
from producer.stalls import stalled_workers
from thinkfleet.broker.clock import RedisClock
from thinkfleet.broker.keys import KombuKeys
from thinkfleet.broker.queues import queue_length
from thinkfleet.settings import Settings
from thinkfleet.state.counters import STALE_GENERATION, check_counters, last_check, read_counts, record_check
from thinkfleet.state.invariant import NotObservable, account, broker_client, live_claims
from thinkfleet.state.places import check_places

#: Unaccounted prompt ids listed in the status (the count is always complete).
UNACCOUNTED_IDS = 20
#: Per-prompt states, in the order they are shown.
STATES = ("total", "queued", "running", "done", "dead", "unaccounted")

#: Window of the "current" rates (and so of the ETA).
DEFAULT_WINDOW_S = 60.0
#: A read scans every prompt's place by itself when the broker holds at most this many messages (queue lists,
#: parked, unacked) and the job at most AUTO_DEEP_PROMPTS prompts: the scan then costs Redis a few ms.
AUTO_DEEP_MESSAGES = 2000
AUTO_DEEP_PROMPTS = 2000
#: Claimed prompt ids per HMGET of their datasets (a counters read with several datasets).
_CLAIM_CHUNK = 1000


@dataclass
class StatusReader:
    """Reads a job's status: from counters (:meth:`read`), or by scanning every prompt's place (``deep``)."""

    client: redis.Redis
    settings: Settings
    job: str
    window_s: float = DEFAULT_WINDOW_S
    #: scan on every read (``status --deep``)
    deep: bool = False
    _last: tuple[float, dict[str, int]] | None = field(default=None, repr=False)
    _clock: RedisClock = field(default_factory=RedisClock, repr=False)

    def read(self, deep: bool | None = None) -> dict[str, Any]:
        """The job's status; ``deep`` True/False forces or forbids the full scan (None: :attr:`deep`, or the
        scan when it is cheap)."""
        keys, job, r = self.settings.keys, self.job, self.client
        record = JobRecord.load(r, keys, job)
        now = self._clock.now(r)  # the timeline and leases are on Redis's clock, not this host's
        if record is None:
            return {"job": job, "exists": False, "finished": False, "at": now}
        try:
            broker = broker_client(r, self.settings)
        except NotObservable:
            broker = None
        messages = broker_messages(broker, self.settings, job) if broker is not None else None
        if deep is None:
            deep = self.deep or self._cheap(messages, record)
        counts = read_counts(r, keys, job, sorted(record.datasets))
        if deep:
            totals, datasets, unaccounted_ids, observable = self._deep(broker)
        else:
            totals, datasets = self._from_counters(counts, broker is not None)
            unaccounted_ids, observable = [], broker is not None
        counters = {k.decode(): int(float(v)) for k, v in r.hgetall(keys.counters(job)).items()}
        workers = {k.decode(): int(float(v)) for k, v in r.hgetall(keys.worker_counters(job)).items()}
        remaining = totals["total"] - totals["done"] - totals["dead"]
        # --turns all: where each conversation stands (a full look once nothing is pending: a chain that stopped
        # without a recorded end leaves nothing pending, and the job is not finished then — thinkfleet/chain_end.py).
        turns = self._turns(counters, deep or remaining == 0)
        stranded = (turns.get("conversations") or {}).get("stranded")
        # Finished only if the sizes of one moment (read_counts: one MULTI, before any scan) say so too. The deep
        # scan reads the prompts, then where each is, in several calls: a finalize between them moves the last
        # pending turns into done and enqueues their successors, which the scan never sees — remaining 0 while
        # later turns are owed (tests/test_wait_turns_race.py).
        finished = remaining == 0 and counts.remaining <= 0 and totals["total"] > 0 and not stranded
        rates = self._rates(now, counters, workers, finished)
        mean_out = counters.get("output_tokens", 0) / counters["done"] if counters.get("done") else None
        tok_s = rates["output_tokens_per_s"]
        eta = remaining * mean_out / tok_s if remaining and mean_out and tok_s else (0.0 if not remaining else None)
        alarm_raw = r.get(keys.alarm(job))
        flags = flags_so_far(r, keys, job, sorted(record.datasets))  # producer/quality_live.py
        flagged = job_flags(counters)
        raw_state = r.get(keys.job_state(job))  # producer pause/cancel (thinkfleet/state/lifecycle.py)
        state = raw_state.decode() if raw_state else ("finished" if finished else "active")
        checked = last_check(r, keys, job)
        if checked is not None:
            checked["age_s"] = round(max(0.0, now - float(checked.get("at") or now)), 1)
        return {
            "job": job,
            "exists": True,
            "at": now,
            "state": state,
            "priority": record.priority,
            "parked": int(r.llen(keys.parked(job))),
            **totals,
            "remaining": remaining,
            "finished": finished,
            "unaccounted_ids": unaccounted_ids[:UNACCOUNTED_IDS],
            "invariant_observable": observable,
            # how the counts were made: "deep" (every prompt's place scanned) or "counters" (O(1) of the queue)
            "mode": "deep" if deep else "counters",
            "checked": checked,  # the last full check's verdict (status --deep, wait, --watch), else null
            "datasets": dict(sorted(datasets.items())),
            "rates": rates,
            "workers": rates.pop("workers"),
            "mean_output_tokens": None if mean_out is None else round(mean_out, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "alarm": _json_or_text(alarm_raw),
            # rows finalized so far with each quality flag, per dataset, and the alarm on degenerate output
            "quality_flags": flags,
            "quality_flags_total": flagged,
            "flag_alarm": flag_alarm(flagged, totals["done"], self.settings),
            "queue_length": queue_length(r, self.settings.queue),
            # messages on the broker a full scan would read (all jobs'; null: not a Redis broker)
            "broker_messages": messages,
            "output_tokens": counters.get("output_tokens", 0),
            "truncated": counters.get("truncated", 0),
            "missing_think_end": counters.get("missing_think_end", 0),
            "nondeterministic_seeds": counters.get("nondeterministic_seeds", 0),  # seeded, server ignores seeds
            # runs of paused-past-their-lease workers refused (thinkfleet/state/ledger.py): nothing of theirs stored
            "fenced": counters.get("fenced", 0),
            # messages of an earlier generation of the job (before a purge and a new submit), skipped by workers
            "stale_generation": counters.get(STALE_GENERATION, 0),
            "max_new_tokens": record.max_new_tokens,
            "job_file": record.job_file,  # the job file as it ran (producer submit job.yaml), else null
            "clock_warnings": clock_warnings(r, self.settings),
            "inflight_bounds": inflight_bounds(r, self.settings),  # producer/bounds.py
            # live workers that hold work with no progress past their bound, each with its reason (producer/stalls.py)
            "stalled_workers": stalled_workers(r, self.settings),
            "image_store_gates": image_store_gates(r, self.settings),  # stores a live worker cannot read (its gates)
            "clock_skew_warn_s": self.settings.clock_skew_warn_s,
            # --turns all: later turns' reusable prefix and the part the servers found cached (host affinity)
            "prefix_cache": prefix_cache(counters),
            **turns,
        }

    def _cheap(self, messages: int | None, record: JobRecord) -> bool:
        """Whether a full scan costs Redis only a few ms: few prompts, few messages on the broker."""
        if (
            record.prompts > AUTO_DEEP_PROMPTS
            or self.client.hlen(self.settings.keys.prompts(self.job)) > AUTO_DEEP_PROMPTS
        ):
            return False
        return messages is None or messages <= AUTO_DEEP_MESSAGES

    def _from_counters(self, counts: Any, observable: bool) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Counts from the counters; running = live claims (read per dataset when there are several)."""
        claimed = live_claims(self.client, self.settings, self.job)
        running_of: dict[str, int] = {}
        names = list(counts.datasets)
        if len(names) == 1:
            running_of[names[0]] = len(claimed)
        elif claimed:
            ids = sorted(claimed)
            key = self.settings.keys.prompt_dataset(self.job)
            for start in range(0, len(ids), _CLAIM_CHUNK):
                for ds in self.client.hmget(key, ids[start : start + _CLAIM_CHUNK]):
                    name = ds.decode() if ds is not None else "?"
                    running_of[name] = running_of.get(name, 0) + 1

        def row(total: int, done: int, dead: int, running: int) -> dict[str, Any]:
            running = min(running, max(0, total - done - dead))
            out: dict[str, Any] = {"total": total, "queued": max(0, total - done - dead - running),
                                   "running": running, "done": done, "dead": dead}  # fmt: skip
            if observable:
                # known without a scan only once nothing is pending: null = not looked for (status --deep)
                out["unaccounted"] = 0 if total - done - dead <= 0 else None
            return out

        datasets = {
            name: row(d["total"], d["done"], d["dead"], running_of.get(name, 0)) for name, d in counts.datasets.items()
        }
        totals = row(counts.total, counts.done, counts.dead, len(claimed))
        if not observable:
            totals["unaccounted"] = None
        return totals, datasets

    def _deep(self, broker: redis.Redis | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[str], bool]:
        """Every prompt looked for where it is (the live invariant); checks the counters and records the verdict."""
        keys, job, r = self.settings.keys, self.job, self.client
        dataset_of = {k.decode(): v.decode() for k, v in r.hgetall(keys.prompt_dataset(job)).items()}
        submitted = set(dataset_of)
        started = time.monotonic()
        if broker is not None:
            acc = account(r, self.settings, job, submitted=submitted, broker=broker)
            state_of, unaccounted_ids = acc.state_of, sorted(acc.unaccounted)
        else:
            # RabbitMQ: its queue is invisible. Live claims are running, the rest is presumed queued.
            done = {m.decode() for m in r.smembers(keys.done(job))}
            dead = {k.decode() for k in r.hkeys(keys.dead(job))}
            running = live_claims(r, self.settings, job)

            def state_of(pid: str) -> str:
                return "done" if pid in done else "dead" if pid in dead else "running" if pid in running else "queued"

            unaccounted_ids = []
        datasets: dict[str, dict[str, Any]] = {}
        for pid, ds in dataset_of.items():
            d = datasets.setdefault(ds, dict.fromkeys(STATES, 0))
            d["total"] += 1
            d[state_of(pid)] += 1
        totals: dict[str, Any] = {s: sum(d[s] for d in datasets.values()) for s in STATES}
        if broker is None:
            totals["unaccounted"] = None
            for d in datasets.values():
                d.pop("unaccounted")
        drift = check_counters(r, keys, job, sorted(datasets))
        record_check(r, keys, job, {
            "unaccounted": totals["unaccounted"], "unaccounted_ids": unaccounted_ids[:UNACCOUNTED_IDS],
            "counter_drift": drift.drift, "repaired": drift.repaired, "took_s": round(time.monotonic() - started, 3),
        })  # fmt: skip
        return totals, datasets, unaccounted_ids, broker is not None

    def _turns(self, counters: dict[str, int], deep: bool = True) -> dict[str, Any]:
        """--turns all: ``conversations`` {total, complete, in_progress, cut_at_tool, chain_ended, ends, dead,
        stranded} and ``turns`` {planned, enqueued, done}, from the job hash's ``turns`` field, the
        ``turns_enqueued`` counter (later turns the workers enqueued), the done set, the dead letters, the submitted
        prompts and the answer records. {} for other jobs. Not ``deep``: only what sizes and counters say (the rest
        needs the scan: null).

        Each conversation's chain is walked from turn 0 along the answer records (thinkfleet/chain_end.py, the rule
        ``producer verify`` applies to the stored rows): complete; chain_ended (a recorded reason, counted per
        reason in ``ends``); dead (its next prompt is dead-lettered); stranded (its last answer goes on to a prompt
        nobody submitted: nothing will run it, the job is not finished); else in progress."""
        from thinkfleet.chain_end import COMPLETE, record_link, walk
        from thinkfleet.turns import (
            TURNS_FIELD,
            answers_key,
            conversations_key,
            regenerates_all_turns,
            split_step_id,
            split_turn_id,
            turn_id,
            turns_meta,
        )

        keys, job, r = self.settings.keys, self.job, self.client
        meta = turns_meta(r.hget(keys.job(job), TURNS_FIELD))
        if not regenerates_all_turns(meta):
            return {}
        if not deep:
            total = max(int(r.hlen(conversations_key(keys, job))), int(meta.get("conversations") or 0))
            unknown = dict.fromkeys(("complete", "in_progress", "chain_ended", "dead", "stranded"))
            return {
                "conversations": {"total": total, **unknown, "cut_at_tool": int(meta.get("cut_at_tool") or 0)},
                "turns": {
                    "planned": int(meta.get("turns") or 0),
                    "enqueued": total + counters.get("turns_enqueued", 0),
                    "done": int(r.scard(keys.done(job))),  # every prompt of a --turns all job is a turn
                },
            }
        agentic = bool(meta.get("tool_results"))  # steps …/t{i}s{j}: the records name what they enqueued (next)
        if keeps_chain_state(r, keys, job):  # the chains' counters and waiting states, not every answer
            return self._turns_from_states(meta, counters, agentic)
        done = {m.decode() for m in r.smembers(keys.done(job))}
        dead = {k.decode() for k in r.hkeys(keys.dead(job))}
        counts = {
            conv.decode(): int(json.loads(raw)["turn_count"])
            for conv, raw in r.hscan_iter(conversations_key(keys, job), count=1000)
        }
        links = {}
        for raw_pid, raw in r.hscan_iter(answers_key(keys, job), count=1000):
            pid, record = raw_pid.decode(), _json_or_text(raw)
            parts = split_step_id(pid)
            if parts is not None and isinstance(record, dict) and parts[0] in counts:
                links[pid] = record_link(pid, counts[parts[0]], record, agentic)
        walks = {conv: walk(conv, links) for conv in counts}
        waiting = sorted({next_id for _, next_id in walks.values() if next_id and next_id not in dead})
        submitted = set()
        if waiting:  # the successors the chains wait for: submitted (pending or done) or not
            flags = r.hmget(keys.prompts(job), waiting)
            submitted = {pid for pid, flag in zip(waiting, flags, strict=True) if flag is not None}
        complete = chain_ended = dead_convs = stranded = 0
        ends: dict[str, int] = {}
        stranded_ids: list[str] = []
        for conv, (chain, next_id) in walks.items():
            end = links[chain[-1]].end if chain and not next_id else None
            if end == COMPLETE:
                complete += 1
            elif end:
                chain_ended += 1
                kind = end.split(":", 1)[0]  # "error: <why>" counts as error
                ends[kind] = ends.get(kind, 0) + 1
            elif next_id in dead or (not chain and turn_id(conv, 0) in dead):
                dead_convs += 1
            elif next_id and next_id not in submitted:
                stranded += 1
                stranded_ids.append(next_id)
        total = max(len(counts), int(meta.get("conversations") or 0))
        turns_done = sum(1 for pid in done if split_turn_id(pid) is not None)
        # executor failures: the chains that end tool_error, counted once by the finalize that stores the end
        tools = {"tool_errors": counters.get(TOOL_ERRORS_FIELD, 0)} if agentic else {}
        return {
            "conversations": {
                "total": total,
                "complete": complete,
                "in_progress": total - complete - chain_ended - dead_convs - stranded,
                "cut_at_tool": int(meta.get("cut_at_tool") or 0),
                "chain_ended": chain_ended,
                "ends": dict(sorted(ends.items())),
                "dead": dead_convs,
                "stranded": stranded,
                "stranded_ids": sorted(stranded_ids)[:UNACCOUNTED_IDS],
                **tools,
            },
            "turns": {
                "planned": int(meta.get("turns") or 0),
                "enqueued": total + counters.get("turns_enqueued", 0),
                "done": turns_done,
            },
        }

    def _turns_from_states(self, meta: dict[str, Any], counters: dict[str, int], agentic: bool) -> dict[str, Any]:
        """:meth:`_turns` (deep) from where finalize.lua counted the chains (producer/chain_state.py): complete and
        ended from the counters, dead and stranded from the states of the chains that go on (at the end of a job,
        only those) — the verdicts of the walk along the answer records, without reading them."""
        from thinkfleet.turns import conversations_key, split_step_id, split_turn_id

        keys, job, r = self.settings.keys, self.job, self.client
        complete, ends = ended_counts(counters)
        chain_ended = sum(ends.values())
        waiting = waiting_states(r, keys, job)
        nexts = sorted({s.next_id for s in waiting.values()})
        dead: set[str] = set()
        submitted: set[str] = set()
        for start in range(0, len(nexts), 10_000):  # the successors the chains wait for: dead, submitted or not
            chunk = nexts[start : start + 10_000]
            with r.pipeline(transaction=False) as pipe:
                for pid in chunk:
                    pipe.hexists(keys.dead(job), pid)
                pipe.hmget(keys.prompts(job), chunk)
                *is_dead, flags = pipe.execute()
            dead.update(pid for pid, d in zip(chunk, is_dead, strict=True) if d)
            submitted.update(pid for pid, flag in zip(chunk, flags, strict=True) if flag is not None)
        dead_convs = stranded = 0
        stranded_ids: list[str] = []
        for state in waiting.values():
            if state.next_id in dead:
                dead_convs += 1
            elif state.next_id not in submitted:
                stranded += 1
                stranded_ids.append(state.next_id)
        # a conversation with no finalized turn is dead when its turn 0 is (the dead letters' ids: a few)
        heads = sorted({p[0] for k in r.hkeys(keys.dead(job)) if (p := split_step_id(k.decode())) and p[1:] == (0, 0)})
        if heads:
            dead_convs += sum(1 for raw in r.hmget(keys.chain_state(job), heads) if raw is None)
        total = max(int(r.hlen(conversations_key(keys, job))), int(meta.get("conversations") or 0))
        if agentic:  # steps are prompts too: count the turn ids among the done
            turns_done = sum(1 for m in r.sscan_iter(keys.done(job), count=5000) if split_turn_id(m.decode()))
        else:  # every prompt of a plain --turns all job is a turn
            turns_done = int(r.scard(keys.done(job)))
        tools = {"tool_errors": counters.get(TOOL_ERRORS_FIELD, 0)} if agentic else {}
        return {
            "conversations": {
                "total": total,
                "complete": complete,
                "in_progress": total - complete - chain_ended - dead_convs - stranded,
                "cut_at_tool": int(meta.get("cut_at_tool") or 0),
                "chain_ended": chain_ended,
                "ends": dict(sorted(ends.items())),
                "dead": dead_convs,
                "stranded": stranded,
                "stranded_ids": sorted(stranded_ids)[:UNACCOUNTED_IDS],
                **tools,
            },
            "turns": {
                "planned": int(meta.get("turns") or 0),
                "enqueued": total + counters.get("turns_enqueued", 0),
                "done": turns_done,
            },
        }

    def _rates(
        self, now: float, counters: dict[str, int], workers: dict[str, int], finished: bool = False
    ) -> dict[str, Any]:
        tl = self.settings.keys.timeline(self.job)
        first = self.client.zrange(tl, 0, 0, withscores=True)
        last = self.client.zrange(tl, -1, -1, withscores=True) if finished else []
        recent = self.client.zrangebyscore(tl, now - self.window_s, "+inf")
        rows = tokens = 0
        for member in recent:
            _ts, n, t = member.decode().rsplit(":", 2)
            rows += int(n)
            tokens += int(t)
        started = first[0][1] if first else None
        span = min(self.window_s, now - started) if started else 0.0
        # A finished job's overall rates are over its run, not until now: elapsed stops at its last commit.
        end = last[0][1] if last else now
        elapsed = end - started if started else 0.0
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


def checked_status(reader: StatusReader, st: dict[str, Any]) -> dict[str, Any]:
    """``st`` (a counters read) with the full check's verdict: unaccounted prompts counted in constant memory
    (:func:`thinkfleet.state.places.check_places`; the full scan where that cannot run), the counters checked and
    repaired, the verdict recorded for plain ``status`` calls."""
    keys, job, r = reader.settings.keys, reader.job, reader.client
    places = check_places(r, reader.settings, job)
    if places is None:  # RabbitMQ, or a broker in another Redis: the scan that holds the sets
        return reader.read(deep=True)
    drift = check_counters(r, keys, job, sorted(st["datasets"]))
    verdict = {
        "unaccounted": places.unaccounted,
        "unaccounted_ids": places.unaccounted_ids,
        "counter_drift": drift.drift,
        "repaired": drift.repaired,
        "took_s": places.took_s,
    }
    record_check(r, keys, job, verdict)
    return {
        **st,
        "queued": max(0, st["queued"] - places.unaccounted),  # a counters read counts lost prompts as queued
        "unaccounted": places.unaccounted,
        "unaccounted_ids": places.unaccounted_ids,
        "checked": {**verdict, "at": time.time(), "age_s": 0.0},
    }


def prefix_cache(counters: dict[str, int]) -> dict[str, Any] | None:
    """Later turns' prefix cache from the job's counters (finalize.lua adds each stored later turn once): ``turns``
    counted, their ``reusable_tokens`` (what the previous turn's server had computed), ``cached_tokens`` (of those,
    what the server found cached) and ``hit_rate`` = cached / reusable. None for a job without later turns."""
    turns = counters.get("prefix_turns", 0)
    if not turns:
        return None
    reusable, cached = counters.get("prefix_reusable_tokens", 0), counters.get("prefix_cached_tokens", 0)
    rate = round(cached / reusable, 4) if reusable else None
    return {"turns": turns, "reusable_tokens": reusable, "cached_tokens": cached, "hit_rate": rate}


def broker_messages(broker: redis.Redis, settings: Settings, job: str) -> int:
    """Messages a full scan would read: the queue's lists (all priorities), the job's parked list and kombu's
    unacked hash (O(1) each)."""
    with broker.pipeline(transaction=False) as p:
        p.llen(settings.keys.parked(job))
        p.hlen(KombuKeys(settings.key_prefix).unacked)
        parked, unacked = p.execute()
    return queue_length(broker, settings.queue) + int(parked) + int(unacked)


def _json_or_text(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


#: Done prompt ids per SSCAN round trip of the final storage check.
_DONE_CHUNK = 5000


def confirm_stored(settings: Settings, job: str, client: redis.Redis, examples: int = 3) -> tuple[int, list[str]]:
    """How many prompt ids Redis calls done that storage does not hold (0 = consistent), with a few of them.

    Both sides stay Arrow arrays (tens of bytes an id, no Python object per prompt): storage's committed ids from
    the streaming reader's first pass (:func:`storage.stream.plan`, keys only), the done set SSCANned a chunk at
    a time."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc

        from storage import layout
        from storage.stream import plan
    except ImportError:  # storage not installed: Redis' done set is all we know
        return 0, []
    stored = plan(layout.locate(settings.output_uri, settings.s3_endpoint_url), job).winners.column("prompt_id")
    chunks, batch = [], []
    for member in client.sscan_iter(settings.keys.done(job), count=_DONE_CHUNK):
        batch.append(member.decode())
        if len(batch) >= _DONE_CHUNK:
            chunks.append(pa.array(batch, pa.string()))
            batch = []
    chunks.append(pa.array(batch, pa.string()))
    done = pa.chunked_array(chunks, pa.string())
    if not len(done):
        return 0, []
    stored_ids = stored.combine_chunks() if isinstance(stored, pa.ChunkedArray) else stored
    absent = pc.invert(pc.is_in(done, value_set=stored_ids.cast(pa.string())))
    missing = done.filter(absent)
    return len(missing), sorted(missing.slice(0, examples).to_pylist())


def confirm_chains(settings: Settings, job: str, client: redis.Redis) -> list[str]:
    """The next prompts that a ``--turns all`` job's stored chains stopped before, with nothing submitted or
    dead-lettered for them (empty: every conversation is complete, ended with a recorded reason, or has a prompt to
    run): the rule ``producer verify`` fails on (MISSING TURNS), read from storage the same way
    (storage/chains.py)."""
    try:
        from storage.chains import owed_in_storage
    except ImportError:  # storage not installed: the answer records' walk (status) is all we know
        return []
    return sorted(owed_in_storage(settings, job, client).values())


@dataclass
class CheckClock:
    """When ``wait``/``--watch`` run their next full check: every ``every_s``, and never more often than
    keeps the scan under ``max_share`` of Redis's time (a check that took t s waits t ÷ max_share)."""

    every_s: float = 300.0
    max_share: float = 0.01
    next_at: float = 0.0
    _last_at: float = field(default=float("-inf"), repr=False)
    _last_took_s: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self.next_at = time.monotonic() + self.every_s

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def may_run_early(self) -> bool:
        """Whether a check now, ahead of ``every_s``, keeps within the share (a suspicion: the broker is empty
        while prompts are pending)."""
        return time.monotonic() >= self._last_at + self._last_took_s / self.max_share

    def ran(self, took_s: float, soon_s: float | None = None) -> None:
        """A check took ``took_s``; the next one after ``soon_s`` (default ``every_s``), bounded by the share."""
        wait_s = self.every_s if soon_s is None else soon_s
        self._last_at, self._last_took_s = time.monotonic(), took_s
        self.next_at = self._last_at + max(wait_s, took_s / self.max_share)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
