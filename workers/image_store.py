"""A worker's view of the image stores it reads: the gate of each store, the remap of a store this host mounts
elsewhere, the count of an image prompt's hand-backs, and the byte budget of the images its requests hold
(docs/vision.md, "When an image cannot be read").

- :class:`StoreGates` — one gate per store root. A store this host cannot read at all (no such directory: a missing
  mount; not a directory; a permission error; S3 AccessDenied) is an I/O fault of the host, not of any prompt: its
  gate closes with that reason, which the heartbeat publishes (``producer status`` shows it), and the worker hands
  that store's image prompts back with a backoff — counting nothing, dead-lettering nothing — while it keeps doing
  every other prompt. A closed gate is checked again at most every ``image_backoff_max_s`` and opens by itself.
- :class:`HandBacks` — an image that cannot be read while its store can (the file is a directory, unreadable, or
  missing on this host) is the prompt's own fault, or this host's: the hand-back is counted on the prompt's
  deliveries record in Redis (``iu``: unreadable, ``im``: missing, with the workers that saw it), so another worker
  may try, and the prompt is dead-lettered once the count reaches its bound (thinkfleet/settings.py
  ``image_handback_max``, ``image_missing_workers``). ``producer retry`` drops the record, so a retried prompt
  starts again from zero.
- :class:`ImageBudget` — the encoded bytes a worker's image requests hold, taken *before* their images are read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import redis.asyncio as aioredis

from storage import layout
from thinkfleet.settings import Settings
from thinkfleet.state.scripts import lua

log = logging.getLogger("thinkfleet.worker")

#: First wait before an image prompt is handed back; it doubles with each hand-back up to ``image_backoff_max_s``.
BACKOFF_BASE_S = 1.0


def backoff_s(tries: int, cap_s: float) -> float:
    """The jittered wait before an image prompt's ``tries``-th hand-back (half to all of the doubled base)."""
    full = min(cap_s, BACKOFF_BASE_S * 2 ** min(30, max(0, tries - 1)))
    return random.uniform(full / 2, full)


def parse_store_map(text: str) -> list[tuple[str, str]]:
    """``FROM=TO[,FROM=TO]`` → [(from, to)], longest prefix first (ValueError for a pair without ``=``)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        src, sep, dst = item.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise ValueError(f"THINKFLEET_IMAGE_STORE_MAP entry {item!r}: write FROM=TO (two path prefixes)")
        pairs.append((src.strip().rstrip("/"), dst.strip().rstrip("/")))
    return sorted(pairs, key=lambda p: len(p[0]), reverse=True)


def probe_store(root: str, s3_endpoint_url: str | None) -> str | None:
    """Why this host cannot read the store at ``root`` (None: it can list it). Cheap: a stat and one listing of
    the root (at most 256 two-character directories)."""
    try:
        loc = layout.locate(root, s3_endpoint_url)
        info = loc.fs.get_file_info(loc.root)
        if info.type == pafs.FileType.NotFound:
            return "no such directory on this host (is the store mounted here, at this path?)"
        if info.type != pafs.FileType.Directory:
            return "not a directory"
        loc.fs.get_file_info(pafs.FileSelector(loc.root, recursive=False))
    except (OSError, ValueError) as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    return None


@dataclass
class _Closed:
    reason: str
    since: float  # wall clock, for status
    checked: float  # monotonic, of the last probe


class StoreGates:
    """The gate of each image store this worker read (or was configured with), by the store's root URI."""

    def __init__(self, settings: Settings, on_change: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.map = parse_store_map(settings.image_store_map)
        self.on_change = on_change  # a gate opened or closed: publish it (the runtime sets the heartbeat's info)
        self._open: set[str] = set()
        self._closed: dict[str, _Closed] = {}
        self._probing: dict[str, asyncio.Future[str | None]] = {}

    def local(self, uri: str) -> str:
        """Where this host reads ``uri`` (a recorded store path or a file in it): the first mapped prefix replaced."""
        for src, dst in self.map:
            if uri == src or uri.startswith(src + "/"):
                return dst + uri[len(src) :]
        return uri

    def closed(self) -> dict[str, dict[str, Any]]:
        """Each closed gate: store root → {reason, since} (the heartbeat's ``image_store_gates``)."""
        return {root: {"reason": c.reason, "since": c.since} for root, c in sorted(self._closed.items())}

    async def check(self, root: str) -> str | None:
        """Why the store at ``root`` is closed now (None: open). Probed on first use, and again — at most every
        ``image_backoff_max_s`` — while closed."""
        if root in self._open:
            return None
        closed = self._closed.get(root)
        if closed is not None and time.monotonic() - closed.checked < self.settings.image_backoff_max_s:
            return closed.reason
        return await self.recheck(root)

    async def recheck(self, root: str) -> str | None:
        """Probe the store now (one probe at a time per store; concurrent callers share it) and set its gate."""
        probing = self._probing.get(root)
        if probing is not None:
            return await asyncio.shield(probing)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._probing[root] = future
        try:
            where = self.local(root)
            reason = await asyncio.to_thread(probe_store, where, self.settings.s3_endpoint_url)
            if reason is not None and where != root:
                reason = f"{reason}; read at {where} (THINKFLEET_IMAGE_STORE_MAP)"
            self._set(root, reason)
            future.set_result(reason)
            return reason
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            self._probing.pop(root, None)

    def _set(self, root: str, reason: str | None) -> None:
        was = self._closed.get(root)
        if reason is None:
            self._open.add(root)
            if was is not None:
                del self._closed[root]
                log.warning("image store %s is readable again: its image prompts run", root)
                self.on_change()
            return
        self._open.discard(root)
        self._closed[root] = _Closed(reason, was.since if was else time.time(), time.monotonic())
        if was is None or was.reason != reason:
            log.error(
                "image store %s: %s — its gate is closed: this worker hands its image prompts back (nothing is "
                "dead-lettered) and goes on with the others; mount the store at this path (or set "
                "THINKFLEET_IMAGE_STORE_MAP) or fix its permissions",
                root,
                reason,
            )
            self.on_change()


class HandBacks:
    """An image prompt's hand-backs, counted on its deliveries record in Redis (thinkfleet/state/lua/image_back.lua)."""

    def __init__(self, redis: aioredis.Redis | None, settings: Settings, identity: str) -> None:
        self.settings = settings
        self.identity = identity
        self._script = redis.register_script(lua("image_back")) if redis is not None else None

    async def count(self, job: str, prompt_id: str, kind: str, generation: str) -> tuple[int, int]:
        """One more hand-back of ``kind`` ('unreadable' or 'missing'): (hand-backs of that kind so far, distinct
        workers that saw it). (0, 0): the prompt is done or dead already, or the job is another generation."""
        if self._script is None:
            return 1, 1
        k = self.settings.keys
        keys = [k.deliveries(job), k.done(job), k.dead(job), k.job(job)]
        got = await self._script(keys=keys, args=[prompt_id, kind[0], self.identity, generation])
        return int(got[0]), int(got[1])


class ImageBudget:
    """Bytes of encoded images held by requests, within ``limit``: :meth:`take` waits (first come, first served)
    until the bytes fit; a request larger than the whole limit runs when nothing else holds any, so it never
    deadlocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        #: The most bytes held at once (bench_vision reads it beside the RSS).
        self.peak = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.limit

    async def take(self, n: int) -> int:
        """Hold ``n`` bytes (returns ``n``, for :meth:`give`)."""
        if not self._waiting and self._fits(n):
            self._hold(n)
            return n
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiting.append(entry)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.give(n)  # granted as it was cancelled: give it on
            else:
                if entry in self._waiting:  # (a grant round may have dropped it already)
                    self._waiting.remove(entry)
                self._grant()
            raise
        return n

    def give(self, n: int) -> None:
        """Give back bytes a request held (its request ended)."""
        self.held -= n
        self._grant()

    def _hold(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def _grant(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            n, future = self._waiting.popleft()
            if future.done():
                continue
            self._hold(n)
            future.set_result(None)
