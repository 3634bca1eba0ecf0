"""A stand-in for SGLang 0.5.9's radix prefix cache (``sglang/srt/mem_cache/radix_cache.py``), for
``meta_info.cached_tokens`` and prefill cost.

The rules are the real server's, read from its source and checked against a real CPU server
(tests/real_sglang/test_real_cache.py):

- **Pages.** Sequences are cut into pages of ``block_tokens`` ids (SGLang's ``--page-size``: 1 on the CPU tier
  and by default; a partial last page is never cached, ``_page_align_keys``). A tree node holds a run of pages.
- **Match** (``Req.init_next_round_input``): a prompt of L ids is matched on its first L - 1 ids (at least one token
  is always computed, for its logits), page-aligned: ``cached_tokens`` is the matched length. A match that ends
  inside a node splits it there (``_match_prefix_helper``), and touches every node on its path.
- **Insert.** An admitted prompt is inserted whole once prefilled (``cache_unfinished_req``), and a finished request's
  prompt + output (``cache_finished_req``: ``kv_committed_len`` ids — with the overlap scheduler, on by default,
  the last output id's KV is computed by the step scheduled before the finish is seen, so all of them).
- **Capacity and eviction.** ``capacity_blocks × block_tokens`` is the KV pool (``--max-total-tokens``). When a
  prefill needs N new slots and fewer are free, N tokens' worth of leaves are evicted (``evict_from_tree_cache``
  asks ``evict(num_tokens=N)``, not the shortfall); decoding takes one slot per output id, evicting a leaf whenever
  none is free. Eviction takes **whole leaf nodes**, least recently used first, a parent joining the candidates
  once its last child is gone (``RadixCache.evict``); the nodes on the path of the request being served are locked.
  So under pressure a history loses its tail segment before its head (the shared system prompt, earlier turns), and
  a segment goes whole.

What it does not model: running requests' KV beside the tree (the engine's ``kv_capacity_tokens`` models admission
and retraction; here a request's own slots count only while it is admitted or finishing), the host tier (HiCache),
and an LRU clock of real time — access order is a counter, so equal-time ties break by creation order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

#: Granularity of a match, in tokens (SGLang's page size; the real CPU tier runs 1).
DEFAULT_BLOCK_TOKENS = 16
#: Pool size in blocks: 262,144 × 16 = 4.2M tokens.
DEFAULT_CAPACITY_BLOCKS = 262_144


class _Node:
    __slots__ = ("children", "key", "last_access", "order", "parent")

    def __init__(self, key: list, parent: _Node | None, access: int, order: int) -> None:
        self.key = key  # page keys
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.last_access = access
        self.order = order


class PrefixCache:
    """The radix tree of one server (see the module doc). Sizes are in tokens; ``len()`` is the tokens it holds."""

    def __init__(
        self, block_tokens: int = DEFAULT_BLOCK_TOKENS, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    ) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError("block_tokens and capacity_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self.capacity_tokens = block_tokens * capacity_blocks
        self._clock = itertools.count(1)
        self._orders = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self.root = _Node([], None, 0, 0)
        self.size_tokens = 0
        #: Nodes without children (the root aside): eviction's candidates.
        self._leaves: set[_Node] = set()

    def __len__(self) -> int:
        return self.size_tokens

    @property
    def free_tokens(self) -> int:
        return max(0, self.capacity_tokens - self.size_tokens)

    # -- what the engine calls --------------------------------------------------------------------
    def match_and_insert(self, input_ids: Sequence[int]) -> int:
        """An admitted prompt: its cached tokens (matched on all but its last id, page-aligned); then its prefill
        takes slots for the rest (evicting when short) and the prompt joins the tree."""
        pages = self._pages(input_ids[: max(0, len(input_ids) - 1)])
        matched, path = self._match(pages)
        cached = matched * self.block_tokens
        need = len(input_ids) - cached
        if self.free_tokens < need:
            self.evict(need, locked=path)
        self._insert(self._pages(input_ids), locked=path)
        return cached

    def insert(self, ids: Sequence[int]) -> None:
        """A finished request's prompt + output ids: its decode took a slot per new id (a leaf evicted whenever none
        was free), and the sequence joins the tree."""
        pages = self._pages(ids)
        known, path = self._walk(pages)
        short = (len(pages) - known) * self.block_tokens - self.free_tokens
        if short > 0:
            self.evict(short, locked=path)
        self._insert(pages, locked=path)

    def cached_length(self, input_ids: Sequence[int]) -> int:
        """What a prompt would find cached now (no side effect)."""
        known, _ = self._walk(self._pages(input_ids[: max(0, len(input_ids) - 1)]))
        return known * self.block_tokens

    def evict(self, num_tokens: int, locked: set[_Node] | frozenset[_Node] = frozenset()) -> int:
        """Evict whole leaves, least recently used first, until ``num_tokens`` are freed (or none is left); a node
        becomes a candidate once its last child is gone. Returns the tokens freed."""
        heap = [(n.last_access, n.order, n) for n in self._leaves if n not in locked]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            self._leaves.discard(node)
            freed += len(node.key) * self.block_tokens
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent not in locked:
                    heapq.heappush(heap, (parent.last_access, parent.order, parent))
        self.size_tokens -= freed
        return freed

    # -- the tree -----------------------------------------------------------------------------------
    def _pages(self, ids: Sequence[int]) -> list:
        p = self.block_tokens
        if p == 1:
            return [int(t) for t in ids]
        flat = [int(t) for t in ids]
        return [tuple(flat[i : i + p]) for i in range(0, len(flat) - p + 1, p)]

    def _walk(self, pages: list) -> tuple[int, set[_Node]]:
        """How many leading pages the tree holds, and the nodes on that path (no change)."""
        node, n, path = self.root, 0, set()
        while n < len(pages):
            child = node.children.get(pages[n])
            if child is None:
                break
            path.add(child)
            k = _common(child.key, pages, n)
            n += k
            if k < len(child.key):
                break
            node = child
        return n, path

    def _match(self, pages: list) -> tuple[int, set[_Node]]:
        """The matched pages (a node the match ends inside is split there), touching the path."""
        n, path, _node = self._descend(pages, next(self._clock))
        return n, path

    def _descend(self, pages: list, now: int) -> tuple[int, set[_Node], _Node]:
        """Follow ``pages`` from the root, touching each node at ``now`` and splitting the one the walk ends inside;
        returns the pages matched, the nodes passed and the node the walk ended at."""
        node, n, path = self.root, 0, set()
        while n < len(pages):
            child = node.children.get(pages[n])
            if child is None:
                break
            child.last_access = now
            k = _common(child.key, pages, n)
            if k < len(child.key):
                child = self._split(child, k, now)
            path.add(child)
            n += k
            node = child  # (after a split the next page differs from the lower part's: the loop ends)
        return n, path, node

    def _insert(self, pages: list, locked: set[_Node]) -> None:
        now = next(self._clock)
        n, path, node = self._descend(pages, now)
        locked |= path
        if n < len(pages):
            leaf = _Node(pages[n:], node, now, next(self._orders))
            node.children[pages[n]] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self.size_tokens += len(leaf.key) * self.block_tokens
            locked.add(leaf)
        # a prompt longer than the pool: what is not locked makes room (the real server would not admit it)
        over = self.size_tokens - self.capacity_tokens
        if over > 0:
            self.evict(over, locked=locked)

    def _split(self, child: _Node, k: int, now: int) -> _Node:
        """Split ``child`` after its first ``k`` pages; returns the new upper node (SGLang's ``_split_node``)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:k], parent, now, next(self._orders))
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper


def _common(key: list, pages: list, start: int) -> int:
    """The length of the common prefix of ``key`` and ``pages[start:]``."""
    n = min(len(key), len(pages) - start)
    for i in range(n):
        if key[i] != pages[start + i]:
            return i
    return n
