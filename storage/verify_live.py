"""``producer verify JOB --live``: the invariant ``total = done + dead + queued + running``, checked while the job runs.

Unlike storage/verify.py it reads only Redis (``thinkfleet.state.invariant``), never storage: it answers "will every
submitted prompt still be run?" at any moment, where the storage check answers "is everything stored?" once the job
has finished. Turns and agentic steps a re-run no longer derives are counted as superseded, not unaccounted, by the
same rules the storage check uses (``thinkfleet.turns.beyond_chain_ends``, storage/verify_steps.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from thinkfleet.redis_client import redacted, sync_client
from thinkfleet.settings import Settings
from thinkfleet.turns import beyond_chain_ends


@dataclass
class LiveReport:
    """``total = done + dead + queued + running`` checked against Redis now (``thinkfleet.state.invariant``)."""

    job: str
    counts: dict[str, int] = field(default_factory=dict)
    unaccounted: list[str] = field(default_factory=list)
    duplicated: int = 0  # finished prompts with a message still queued or delivered: a redelivery, fine
    error: str = ""  # why the invariant could not be checked (no job, Redis unreachable, RabbitMQ broker)

    @property
    def ok(self) -> bool:
        return not (self.unaccounted or self.error)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_live(settings: Settings, job: str) -> LiveReport:
    """Every submitted prompt of ``job`` is done, dead-lettered, queued or running — right now."""
    import redis

    from thinkfleet.state.invariant import NotObservable, account

    report = LiveReport(job=job)
    # Bounded like every other read of verify: a Redis that does not answer is reported, never waited on forever.
    client = sync_client(settings.redis_url, timeout_s=10)
    try:
        if not client.exists(settings.keys.prompts(job)):
            report.error = f"job {job!r} has no submitted prompts in Redis at {redacted(settings.redis_url)}"
            return report
        acc = account(client, settings, job)
    except NotObservable as exc:
        report.error = f"{exc}; --live needs a Redis broker"
        return report
    except redis.RedisError as exc:
        report.error = f"cannot reach Redis at {redacted(settings.redis_url)}: {exc}"
        return report
    finally:
        client.close()
    report.counts = acc.counts()
    # Turns a re-run no longer derives (past their chain end) left done for good: superseded, not unaccounted.
    from storage.verify_steps import unreachable_steps

    gone = beyond_chain_ends(acc.unaccounted, _chain_ends(settings, job) or set())
    gone |= unreachable_steps(settings, job, acc.unaccounted)  # agentic: steps no current chain reaches
    report.unaccounted = sorted(set(acc.unaccounted) - gone)
    if gone:
        report.counts["unaccounted"] -= len(gone)
        report.counts["superseded"] = len(gone)
    report.duplicated = len(acc.duplicated)
    return report


def format_live_report(report: LiveReport, limit: int = 20) -> str:
    if report.error:
        return f"job {report.job} (live): CANNOT CHECK — {report.error}"
    c = report.counts
    lines = [
        f"job {report.job} (live): {'OK' if report.ok else 'FAILED'}",
        f"  total {c['total']} = done {c['done']} + dead {c['dead']} + queued {c['queued']} + running "
        f"{c['running']}"
        + (f" + superseded {c['superseded']}" if c.get("superseded") else "")
        + (f" + UNACCOUNTED {c['unaccounted']}" if c["unaccounted"] else ""),
    ]
    if report.duplicated:
        lines.append(f"  {report.duplicated} finished prompt(s) still have a message queued or delivered (redelivery)")
    if report.unaccounted:
        lines.append(
            f"UNACCOUNTED: {len(report.unaccounted)} (not stored, not dead-lettered, not queued, not running: "
            "nothing will run them; producer submit re-enqueues them)"
        )
        lines.extend(f"  {pid}" for pid in report.unaccounted[:limit])
        if len(report.unaccounted) > limit:
            lines.append(f"  … and {len(report.unaccounted) - limit} more (--json lists all)")
    return "\n".join(lines)


def _chain_ends(settings: Settings, job: str) -> set[str] | None:
    """Turn prompt ids whose answer record (``Keys.turn_answers``) says ``chain_end``; None: Redis
    could not be read."""
    import json

    import redis

    key = settings.keys.turn_answers(job)
    try:
        client = sync_client(settings.redis_url, timeout_s=5)
        with client:
            ends = set()
            for pid, raw in client.hscan_iter(key, count=1000):
                if b"chain_end" in raw:
                    try:
                        if "chain_end" in json.loads(raw):
                            ends.add(pid.decode())
                    except ValueError:
                        continue
            return ends
    except (redis.RedisError, OSError):
        return None
