"""Quality flags so far (issue 46): what ``producer status`` shows of the rows finalized until now — truncated and
each flag per dataset — and the **flag alarm**, the reasoning alarm's sibling for degenerate output.

Workers decide a row's flags when they make it (storage/quality.py) and finalize.lua counts them as the row becomes
done (``flag:NAME`` in the job's and each dataset's counters), so reading them costs one HGETALL per dataset. They
count finalized rows: a row a ``retry --truncated`` replaced later stays counted, and a recovered orphan's flags are
not read back; ``verify``, ``report`` and the card count the committed view from storage exactly.

The flag alarm fires once ``alarm_min_rows`` rows are done and at least ``alarm_missing_share`` of them are loops or
empty answers: a server whose sampling is broken (a bad temperature, a wrong stop id, a drafter that degenerates)
fills the job with data a drafter learns nothing from, and nothing else would say so before the job ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from thinkfleet.keys import Keys
from thinkfleet.settings import Settings

#: The flags counted live, in the order status shows them (storage/flags.py's FLAG_NAMES).
LIVE_FLAGS = ("truncated", "loop", "no_think_end", "empty_answer", "tool_call_unparsed")
#: The flags the alarm watches: rows that look like data and teach nothing.
ALARM_FLAGS = ("loop", "empty_answer")


def flags_so_far(client: redis.Redis, keys: Keys, job: str, datasets: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per dataset, the finalized rows carrying each flag so far (0 for none)."""
    with client.pipeline(transaction=False) as pipe:
        for name in datasets:
            pipe.hgetall(keys.dataset_counters(job, name))
        found = pipe.execute()
    out: dict[str, dict[str, int]] = {}
    for name, fields in zip(datasets, found, strict=True):
        values = {k.decode(): int(float(v)) for k, v in fields.items()}
        out[name] = {flag: values.get(f"flag:{flag}", 0) for flag in LIVE_FLAGS}
    return out


def job_flags(counters: dict[str, int]) -> dict[str, int]:
    """The whole job's flagged rows so far, from its counters (finalize.lua counts them there too)."""
    return {
        flag: counters.get(f"flag:{flag}", counters.get(flag, 0) if flag == "truncated" else 0) for flag in LIVE_FLAGS
    }


def flag_alarm(flags: dict[str, int], done: int, settings: Settings) -> dict[str, Any] | None:
    """The alarm (None when it does not fire): loops and empty answers among the rows done so far (``flags``: the
    job's, :func:`job_flags`)."""
    flagged = {f: flags.get(f, 0) for f in ALARM_FLAGS}
    bad = sum(flagged.values())
    if done < settings.alarm_min_rows or not done or bad / done < settings.alarm_missing_share:
        return None
    return {
        "rows": done,
        **flagged,
        "share": round(bad / done, 4),
        "message": (
            f"{bad:,} of {done:,} rows so far are degenerate (loops {flagged['loop']:,}, empty answers "
            f"{flagged['empty_answer']:,}): check the server's sampling (temperature, stop ids, the drafter) before "
            "the job spends more GPU-hours; export with --drop-flag loop,empty_answer to leave them out"
        ),
    }
