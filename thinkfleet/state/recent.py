"""The latest N of something this process wrote to Redis, to write it again if Redis lost it (a rollback).

The committer remembers its latest finalized rows and the ledger its latest dead letters: both replay them when
their finalize marks show that Redis lost a suffix of their writes (:meth:`thinkfleet.state.ledger.Ledger.
lost_finalizes`). Bounded, because a worker lives for days; a rollback loses seconds of writes, not thousands.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict[K, V]):
    """An insertion-ordered map of at most ``size`` entries: remembering a key again makes it the newest, and the
    oldest entries go when it is full."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def remember(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
