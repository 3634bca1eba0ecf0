"""A cheap stand-in for SGLang's radix prefix cache, for ``meta_info.cached_tokens`` and prefill cost.

A prompt is cut into blocks of ``block_tokens`` ids; block k is keyed by a hash chained over blocks
0..k, so a key identifies a whole prefix. A new prompt's cached length is the longest run of leading
block keys already present (rounded down to a block, at most ``len - 1``: SGLang always computes at
least one token). Keys live in an LRU of ``capacity_blocks`` entries. Matching and inserting are
O(prompt length); memory is bounded.

As SGLang's radix tree: a prompt's blocks are cached when it is admitted (prefilled), and a finished request's
prompt + output (:meth:`PrefixCache.insert`, the engine at finish: ``cache_finished_req``), so the next turn of a
conversation finds its whole history cached on the host that ran the turn before it. Eviction takes leaves first:
a sequence's blocks are touched deepest first, so under pressure a history loses its tail before its head (the
shared system prompt, the earlier turns) — never its head while its tail stays unmatched behind it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

#: Granularity of a match, in tokens (a real radix tree matches token by token).
DEFAULT_BLOCK_TOKENS = 16
#: LRU size in blocks: 262,144 × 16 = 4.2M prompt tokens remembered, ~40 MB.
DEFAULT_CAPACITY_BLOCKS = 262_144


class PrefixCache:
    def __init__(
        self, block_tokens: int = DEFAULT_BLOCK_TOKENS, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    ) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError("block_tokens and capacity_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def block_keys(self, input_ids: Sequence[int]) -> list[bytes]:
        """Chained keys of the prompt's full blocks."""
        raw = np.asarray(input_ids, dtype="<u4").tobytes()
        step = 4 * self.block_tokens
        keys: list[bytes] = []
        previous = b""
        for start in range(0, len(raw) - step + 1, step):
            previous = hashlib.blake2b(previous + raw[start : start + step], digest_size=12).digest()
            keys.append(previous)
        return keys

    def match_and_insert(self, input_ids: Sequence[int], keys: list[bytes] | None = None) -> int:
        """Cached tokens for this prompt; then remember its blocks (as SGLang caches after prefill)."""
        keys = self.block_keys(input_ids) if keys is None else keys
        matched = 0
        for key in keys:
            if key not in self._lru:
                break
            matched += 1
        self._touch(keys)
        return max(0, min(matched * self.block_tokens, len(input_ids) - 1))

    def insert(self, ids: Sequence[int]) -> None:
        """Remember a finished sequence's blocks (its prompt + output ids), without a match."""
        self._touch(self.block_keys(ids))

    def _touch(self, keys: list[bytes]) -> None:
        # Deepest block first: the head ends most recent, so the LRU evicts a history's tail before its head.
        for key in reversed(keys):
            self._lru[key] = None
            self._lru.move_to_end(key)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
