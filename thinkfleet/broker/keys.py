"""kombu's key names on Redis, in one place (thinkfleet's own keys are in :mod:`thinkfleet.keys`).

The queue is a list named after the queue, one more per priority step (``queue`` for 0, the highest;
``queue\\x06\\x16N`` for N = 1..9: kombu's ``sep`` and ``priority_steps``). Ack emulation keeps delivered
messages in the ``unacked`` hash, scored by delivery time in the ``unacked_index`` sorted set, swept under
``unacked_mutex``: :func:`kombu_transport_options` names them under our prefix, so one Redis can serve
several isolated deployments. Pure names: importing this module imports neither kombu nor Celery.
"""

from __future__ import annotations

from dataclasses import dataclass

#: kombu's separator between a queue's name and its priority step (transport option ``sep``).
PRIORITY_SEP = "\x06\x16"
#: The priority steps (transport option ``priority_steps``): 0 is the highest, 9 the lowest.
PRIORITY_STEPS = tuple(range(10))


def priority_step(priority: int | None) -> int:
    """A job's priority as a kombu step: 0 (highest, the default) … 9 (lowest); out of range is clamped."""
    return min(max(int(priority or 0), PRIORITY_STEPS[0]), PRIORITY_STEPS[-1])


def priority_list(queue: str, priority: int | None) -> str:
    """The list a message of ``priority`` is queued on (kombu's ``_q_for_pri``): 0 is ``queue`` itself."""
    step = priority_step(priority)
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def priority_lists(queue: str) -> list[str]:
    """Every priority list of ``queue``, highest first (``KEYS`` of the priority-aware Lua scripts)."""
    return [priority_list(queue, step) for step in PRIORITY_STEPS]


#: Between a queue's name and a worker's name in that worker's host list (:func:`host_queue`).
HOST_INFIX = ":host:"


def host_queue(queue: str, worker: str) -> str:
    """The step-0 list of ``worker``'s host-affine messages on ``queue`` (thinkfleet/broker/affinity.py): a
    conversation's next turn offered first to the host whose server holds its prefix. Its priority lists follow
    kombu's scheme (:func:`priority_list` of this name). Under the queue's name, so every ACL user that may touch
    the queue may touch it (``~{queue}*``)."""
    return f"{queue}{HOST_INFIX}{worker}"


def host_lists(queue: str, worker: str) -> list[str]:
    """Every priority list of ``worker``'s host list on ``queue``, highest first."""
    return priority_lists(host_queue(queue, worker))


def host_glob(queue: str) -> str:
    """A SCAN pattern matching every worker's host lists on ``queue`` (every priority step)."""
    return _glob_escape(queue + HOST_INFIX) + "*"


def host_owner(queue: str, key: str) -> str | None:
    """The worker a host list (any priority step) of ``queue`` belongs to; None for any other key."""
    head = queue + HOST_INFIX
    if not key.startswith(head):
        return None
    return key[len(head) :].split(PRIORITY_SEP, 1)[0] or None


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class KombuKeys:
    """kombu's ack-emulation keys under a prefix: ``KombuKeys("tf").unacked == "tf:kombu:unacked"``."""

    prefix: str

    @property
    def unacked(self) -> str:
        """HASH delivery tag → JSON ``[message, exchange, routing_key]``: delivered, not yet acknowledged."""
        return f"{self.prefix}:kombu:unacked"

    @property
    def unacked_index(self) -> str:
        """ZSET delivery tag → delivery time: restored to the queue once older than the visibility timeout."""
        return f"{self.prefix}:kombu:unacked_index"

    @property
    def unacked_holder(self) -> str:
        """HASH delivery tag → ``{worker}/{nonce}``, the one delivery whose entry ``unacked`` holds now (written with
        the entry): an ack, reject, hand-back or renewal of another delivery of the same message leaves the entry
        alone (thinkfleet/broker/transit.py). Removed with the entry."""
        return f"{self.prefix}:kombu:unacked_holder"

    @property
    def unacked_mutex(self) -> str:
        """STRING with TTL: held by the one process sweeping ``unacked_index``."""
        return f"{self.prefix}:kombu:unacked_mutex"


def kombu_transport_options(prefix: str, visibility_timeout_s: float) -> dict[str, object]:
    """Redis transport options that keep kombu's ack-emulation keys under our prefix.

    The visibility timeout must be identical everywhere Celery reads it (broker transport options,
    result backend options and ``visibility_timeout``); callers pass this dict to all of them.
    """
    keys = KombuKeys(prefix)
    return {
        "visibility_timeout": int(visibility_timeout_s),
        "unacked_key": keys.unacked,
        "unacked_index_key": keys.unacked_index,
        "unacked_holder_key": keys.unacked_holder,  # our transport's (transit.py); kombu's stock one ignores it
        "unacked_mutex_key": keys.unacked_mutex,
        # A lost worker's messages are restored by our reaper, so the mutex only guards the sweep. A worker killed
        # while it holds it blocks every sweep of the prefix until it expires: short (a sweep takes well under a
        # second; two at once are safe: kombu restores each tag in a transaction).
        "unacked_mutex_expire": 30,
    }
