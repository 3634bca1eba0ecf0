"""A ``--turns all`` job's prefix cache, from its committed rows (``producer report``'s ``prefix_cache``).

A later turn (or tool step) carries ``prefix_reusable_tokens``: how much of its prompt its previous turn's server had
already computed (the longest common prefix with that turn's prompt + output ids). The server says how much it found
cached (``cached_tokens``). Over the later turns: the reusable tokens, the cached part of them, the hit rate
cached / reusable, and how many later turns ran on the host of their previous turn (the row's ``worker``: host
affinity, thinkfleet/broker/affinity.py). ``producer status`` shows the same rate live from the job's counters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import CACHED_TOKENS, CONVERSATION_ID, PREFIX_REUSABLE_TOKENS, STEP_INDEX, TURN_INDEX, WORKER

#: The columns :func:`prefix_summary` reads.
PREFIX_COLUMNS = [CONVERSATION_ID, TURN_INDEX, STEP_INDEX, WORKER, CACHED_TOKENS, PREFIX_REUSABLE_TOKENS]


def prefix_summary(table: pa.Table) -> dict[str, Any] | None:
    """``{turns, reusable_tokens, cached_tokens, hit_rate, same_host, same_host_share}`` over the rows that carry a
    reusable prefix (cached capped at it; rows whose server reported no cached count are left out); None when no
    row carries one (a single-turn job, or parts written before the column)."""
    if PREFIX_REUSABLE_TOKENS not in table.column_names or table[PREFIX_REUSABLE_TOKENS].null_count == table.num_rows:
        return None
    chain = table.filter(pc.is_valid(table[CONVERSATION_ID]))
    steps = chain[STEP_INDEX].fill_null(0) if STEP_INDEX in chain.column_names else pa.array([0] * chain.num_rows)
    order = pc.sort_indices(
        pa.table({"c": chain[CONVERSATION_ID], "t": chain[TURN_INDEX].fill_null(0), "s": steps}),
        sort_keys=[("c", "ascending"), ("t", "ascending"), ("s", "ascending")],
    )
    chain = chain.take(order)
    convs = chain[CONVERSATION_ID].to_pylist()
    workers = chain[WORKER].to_pylist()
    reusable = chain[PREFIX_REUSABLE_TOKENS].to_pylist()
    cached = chain[CACHED_TOKENS].to_pylist()
    counted = same = 0
    total_reusable = total_cached = 0
    for i, n in enumerate(reusable):
        if n is None or cached[i] is None:
            continue
        counted += 1
        total_reusable += int(n)
        total_cached += min(int(cached[i]), int(n))
        same += int(i > 0 and convs[i - 1] == convs[i] and workers[i - 1] == workers[i])
    rate = float(np.round(total_cached / total_reusable, 4)) if total_reusable else None
    return {
        "turns": counted,
        "reusable_tokens": total_reusable,
        "cached_tokens": total_cached,
        "hit_rate": rate,
        "same_host": same,
        "same_host_share": round(same / counted, 4) if counted else None,
    }


def prefix_rows(summary: dict[str, Any] | None) -> dict[str, str]:
    """The report's lines for it (terminal and HTML), {} without one."""
    if not summary:
        return {}
    rate = "n/a" if summary["hit_rate"] is None else f"{summary['hit_rate']:.1%}"
    share = "n/a" if summary["same_host_share"] is None else f"{summary['same_host_share']:.1%}"
    return {
        "prefix cache hit rate (later turns)": f"{rate} ({summary['cached_tokens']:,} of "
        f"{summary['reusable_tokens']:,} reusable tokens cached)",
        "later turns on their previous turn's host": f"{share} ({summary['same_host']:,} of {summary['turns']:,})",
    }
