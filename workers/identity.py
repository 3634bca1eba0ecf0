"""One identity per live worker: who holds a worker name, and what a second process under it does.

A worker's name (``--name`` / ``THINKFLEET_WORKER_NAME``, else ``hostname-pid``) owns its claims in Redis
(thinkfleet/state/ledger.py). Two live processes under one name — the name copied between hosts, a common
compose mistake — would each take the other's claims as their own, and the second's start-up
``abandon_claims`` would orphan the first's live claims. So the name is *held*: the heartbeat key
(:meth:`thinkfleet.keys.Keys.heartbeat`, a JSON value with a TTL of one lease) carries its holder —
:func:`holder_record`: host, pid, a random per-process ``nonce``, start time, the kernel's boot id and the
pid namespace — and every write of it is a compare-and-set on the nonce (workers/lease.py).

At start, before anything under the name is touched (:func:`acquire_name`), a worker whose name's heartbeat
is held by another nonce tells a dead previous life from a live twin, deterministically:

- the same host (hostname and boot id) and the same pid: our own previous life (a restarted container) —
  taken over at once;
- the same host and pid namespace and that pid no longer runs (a SIGKILLed worker restarted under its
  ``--name``): dead — taken over at once;
- otherwise it watches the value for up to one lease (a live holder rewrites it every ``lease_s / 4``, a
  dead one's expires within ``lease_s``): expired → taken over; rewritten by the same nonce → a live twin:
  the worker refuses to start (:class:`NameHeld`, exit 78 naming the other host and pid), nothing consumed.

A twin that slipped past anyway (a holder paused past its lease while another process took the name) is
caught by the compare-and-set: a running worker whose heartbeat is held by another nonce stops consuming,
hands back everything it holds and writes nothing more under the name (:class:`GuardedLedger`). What it finds
may instead be an earlier, dead life's heartbeat that a Redis rollback brought back (:func:`earlier_life`:
its pid is gone from this host, or it began holding the name — ``since``, Redis time — before we did): that
one is overwritten.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from thinkfleet.state.ledger import Ledger

log = logging.getLogger("thinkfleet.worker")

#: Longest a start waits on another process's heartbeat, in leases (one lease decides it; the rest is a
#: holder that changes hands while we watch).
ACQUIRE_LEASES = 3.0


class NameHeld(RuntimeError):
    """Another live process holds this worker's name: this one must not start."""


class IdentityLost(RuntimeError):
    """This process's heartbeat is held by another process under the same name: nothing more is written."""


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def holder_record(started_at: float | None = None) -> dict[str, Any]:
    """Who this process is, as its heartbeat says: host, pid, a fresh random nonce, start time (host clock),
    boot id and pid namespace (what makes "that pid no longer runs" a fact rather than a guess)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "nonce": uuid.uuid4().hex,
        "started_at": time.time() if started_at is None else started_at,
        "boot_id": _boot_id(),
        "pidns": _pid_namespace(),
    }


def parse_holder(raw: bytes | str | None) -> dict[str, Any] | None:
    """A heartbeat value as a dict (None: absent or not JSON — an older or foreign writer)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "a process that does not say who it is (a heartbeat without a holder)"
    what = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    started = holder.get("started_at")
    if isinstance(started, int | float):
        what += f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
    return what


def _same_host(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return (
        theirs.get("host") == ours.get("host")
        and ours.get("boot_id") is not None
        and theirs.get("boot_id") == ours.get("boot_id")
    )


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def previous_life(ours: dict[str, Any], theirs: dict[str, Any] | None) -> str | None:
    """Why ``theirs`` (another nonce's heartbeat) is certainly not a live process, or None when only
    watching it can tell."""
    if not theirs or not _same_host(ours, theirs):
        return None
    pid = theirs.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    if pid == ours.get("pid"):
        return "our own previous life (same host, same pid)"
    if ours.get("pidns") is not None and theirs.get("pidns") == ours.get("pidns") and not _pid_runs(pid):
        return f"its pid {pid} no longer runs on this host"
    return None


def earlier_life(ours: dict[str, Any], theirs: dict[str, Any] | None) -> str | None:
    """Why ``theirs``, found by a running worker's beat in place of its own heartbeat, is certainly a dead life
    of the name and not a twin (None: it may be a live process that took the name, e.g. while we were paused
    past our lease). Either :func:`previous_life` says so, or it began holding the name before we did
    (``since``, Redis time): a holder older than us cannot have written after we took the name (its own
    compare-and-set fails), so its value is back from a Redis rollback to an older snapshot."""
    dead = previous_life(ours, theirs)
    if dead is not None or not theirs:
        return dead
    mine, since = ours.get("since"), theirs.get("since")
    if isinstance(mine, int | float) and isinstance(since, int | float) and since < mine:
        return f"an earlier life of the name ({describe_holder(theirs)}; a Redis rollback brought it back?)"
    return None


#: One heartbeat write: (written?, the value found when not written).
Beat = Callable[[bytes | None], Awaitable[tuple[bool, bytes | None]]]


async def acquire_name(
    worker: str,
    ours: dict[str, Any],
    beat: Beat,
    read: Callable[[], Awaitable[tuple[bytes | None, int]]],
    lease_s: float,
    poll_s: float | None = None,
) -> str | None:
    """Hold ``worker``'s heartbeat for this process, or raise :class:`NameHeld`.

    ``beat(expected)`` writes our heartbeat if the key is absent, holds our nonce, or holds exactly
    ``expected`` (a previous life's value we take over); it returns whether it wrote and what it found.
    ``read()`` returns the key's value and its PTTL in ms. Returns a line for the log when a previous life's
    heartbeat was taken over, else None."""
    poll = poll_s if poll_s is not None else min(0.25, max(0.02, lease_s / 20))
    give_up = time.monotonic() + ACQUIRE_LEASES * lease_s + 2.0
    expected: bytes | None = None
    while True:
        written, found = await beat(expected)
        if written:
            if expected is None:
                return None
            return f"took over worker name {worker!r} from {describe_holder(parse_holder(expected))}"
        theirs = parse_holder(found)
        dead = previous_life(ours, theirs)
        if dead is not None:
            log.warning("worker name %r: its heartbeat is %s: taking it over", worker, dead)
            expected = found
            continue
        if time.monotonic() >= give_up:
            raise NameHeld(_held_message(worker, theirs, "it changed hands while this worker watched it"))
        # Watch it: a live holder rewrites it every lease/4; a dead one's expires within its TTL (≤ a lease).
        log.warning(
            "worker name %r is held by %s: waiting up to %.0f s to see whether that process lives",
            worker,
            describe_holder(theirs),
            lease_s,
        )
        first, ttl_ms = await read()
        deadline = time.monotonic() + max(lease_s, (ttl_ms if ttl_ms > 0 else 0) / 1000) + 1.0
        expected = None
        while True:
            if first is None:
                break  # expired while we looked: take it (the next beat writes)
            now_raw, ttl_ms = await read()
            if now_raw is None:
                break
            if now_raw != first:
                now = parse_holder(now_raw)
                if theirs is not None and now is not None and now.get("nonce") == theirs.get("nonce"):
                    raise NameHeld(_held_message(worker, now, "its heartbeat was refreshed while this worker watched"))
                if theirs is None and now is None:
                    raise NameHeld(_held_message(worker, None, "its heartbeat was refreshed while this worker watched"))
                break  # another process took it meanwhile: judge the new holder
            if time.monotonic() >= deadline:
                raise NameHeld(
                    _held_message(
                        worker,
                        theirs,
                        f"its heartbeat neither expired nor was refreshed within {lease_s:.0f} s "
                        f"(TTL {ttl_ms} ms; a heartbeat without a TTL never expires)",
                    )
                )
            await asyncio.sleep(poll)


def _held_message(worker: str, holder: dict[str, Any] | None, why: str) -> str:
    return (
        f"worker name {worker!r} is held by another live worker: {describe_holder(holder)} ({why}); "
        "two workers under one name would take each other's claims as their own. Give each worker its own "
        "--name / THINKFLEET_WORKER_NAME (or leave it unset: hostname-pid)"
    )


class GuardedLedger(Ledger):
    """The ledger of a worker that may lose its name: once :meth:`suspend` is called (its heartbeat is held
    by another process under the same name) nothing more is written under the name — every transition
    raises :class:`IdentityLost`, except the clean hand-back (``release``) and the sweep for stray claims
    (``abandon_claims``), which do nothing: the claims may be the other process's. Its messages go back to
    the queue unacknowledged."""

    suspended: str | None = None

    def suspend(self, why: str) -> None:
        self.suspended = why

    def _refuse(self) -> None:
        if self.suspended is not None:
            raise IdentityLost(f"worker name {self.worker!r} is not ours any more: {self.suspended}")

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().claim(*args, **kwargs)

    async def release(self, *args: Any, **kwargs: Any) -> Any:
        if self.suspended is not None:
            return None
        return await super().release(*args, **kwargs)

    async def crashed(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().crashed(*args, **kwargs)

    async def mark_part(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().mark_part(*args, **kwargs)

    async def finalize(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().finalize(*args, **kwargs)

    async def dead_letter(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().dead_letter(*args, **kwargs)

    async def tool_call(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return await super().tool_call(*args, **kwargs)

    async def came_back(self, *args: Any, **kwargs: Any) -> Any:
        if self.suspended is not None:
            return False  # the charges under the name may be the other process's
        return await super().came_back(*args, **kwargs)

    async def abandon_claims(self, *args: Any, **kwargs: Any) -> Any:
        if self.suspended is not None:
            return 0  # the claims under the name may be the other process's
        return await super().abandon_claims(*args, **kwargs)
