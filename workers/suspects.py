"""The last-chance prompts one worker runs at once: its *suspect group* (thinkfleet/state/ledger.py).

A prompt one crash short of ``max_deliveries`` is a suspect: the deaths charged to it may all be its neighbours'
doing (a killed worker cannot say which prompt killed it). Suspects are resolved by group testing instead of one at
a time: a worker runs them together, alongside its other work, and a worker's death takes all its runs at once, so
the suspects it runs together are one group whatever job they belong to. A group that dies is split — claim.lua
halves each member's cap ``g`` to half the group's size — so a culprit that kills every worker ends up running alone
within ⌊log2 n⌋ deaths and is proven poison by two deaths alone, while a group without it simply completes.

:class:`SuspectGroup` admits a suspect when the group, counting it, fits its own cap and every member's: the
caps only bind after a death, so bystanders of external deaths run at full concurrency. Admission is first come,
first served, so a prompt waiting to run alone is not starved by larger caps behind it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable

#: A cap of 0 (no death split the prompt's group yet) admits any group.
NO_CAP = 1 << 30


def cap_of(record: dict[str, object] | None) -> int:
    """The group cap a ``suspect`` answer's delivery record sets (``g``; absent or 0: none)."""
    value = (record or {}).get("g")
    return int(value) if isinstance(value, int | float) and value > 0 else NO_CAP


class SuspectGroup:
    """The suspects this process runs now (each delivery's place → its cap), and the FIFO of those waiting."""

    def __init__(self) -> None:
        self._caps: dict[Hashable, int] = {}
        self._waiting: deque[object] = deque()
        self._changed = asyncio.Condition()
        #: The largest the group has been (for logs and tests: > 1 means suspects overlapped).
        self.largest = 0

    def __len__(self) -> int:
        return len(self._caps)

    def _fits(self, cap: int) -> bool:
        size = len(self._caps) + 1
        return size <= cap and all(size <= c for c in self._caps.values())

    async def join(self, run: Hashable, cap: int) -> int:
        """Wait for room (in arrival order), then join; returns the group's size with this run."""
        ticket = object()
        async with self._changed:
            self._waiting.append(ticket)
            try:
                await self._changed.wait_for(lambda: self._waiting[0] is ticket and self._fits(cap))
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()
            self._caps[run] = cap
            self.largest = max(self.largest, len(self._caps))
            return len(self._caps)

    async def leave(self, run: Hashable) -> None:
        async with self._changed:
            if self._caps.pop(run, None) is not None:
                self._changed.notify_all()
