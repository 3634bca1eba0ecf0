"""What kind of error a commit met, and so what it ends (workers/committer.py; docs/reliability.md "Every wait and
retry has a bound").

An error ends only what caused it: I/O (storage, Redis) is nobody's row — the commit is retried behind the storage
gate for as long as it lasts; an error of a row's hooks (a next turn the template refuses, a tool result JSON cannot
hold) ends that row only — at once for a data error, after :data:`UNKNOWN_ERROR_ATTEMPTS` tries for an unknown one.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from storage.writer import StorageNotWritable
from workers.identity import IdentityLost

#: Tries a commit group's hooks get at an unknown error (neither I/O nor a data error) before the group is committed
#: row by row and the row whose own hooks still raise is dead-lettered (a data error gets one).
UNKNOWN_ERROR_ATTEMPTS = 3
#: Errors of the data a hook was given (a history the template refuses, a value JSON cannot hold): retrying the same
#: rows gives the same error, so the row is found at once.
DATA_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, ValueError, LookupError, ArithmeticError, AttributeError, AssertionError, RecursionError,
)  # fmt: skip


#: How Redis words an error raised inside a Lua script (7: ``user_script:<line>:``, 6: ``Error running script``): the
#: script's own, deterministic — not I/O, though it comes as a ResponseError like a failover's READONLY does.
SCRIPT_ERROR_MARKS = ("user_script:", "Error running script")


def io_fault(exc: BaseException) -> bool:
    """Storage or Redis I/O (or a lost worker name, which only a hand-back ends): not a row's fault, retried behind
    the storage gate for as long as it lasts. A Lua script's own error is not I/O (workers/stall.py ends a commit
    stream stuck on one)."""
    if isinstance(exc, ResponseError) and any(m in str(exc) for m in SCRIPT_ERROR_MARKS):
        return False
    return isinstance(exc, OSError | RedisError | StorageNotWritable | IdentityLost)


def data_fault(exc: BaseException) -> bool:
    """An error of a row's data (:data:`DATA_ERRORS`, or jinja2's TemplateError: a chat template's
    ``raise_exception``): the row is found and ended at once."""
    return isinstance(exc, DATA_ERRORS) or any(c.__module__.startswith("jinja2") for c in type(exc).__mro__)


@dataclass(frozen=True)
class CommitProgress:
    """What the committer holds and since when (monotonic seconds ago; None: nothing of that kind)."""

    waiting: int  # rows handed to the committer and not yet committed or ended
    oldest_s: float | None  # how long the oldest of them has waited
    since_commit_s: float  # since the last group committed (or the committer started)
    failing: str | None  # the error the current group's last attempt failed with ("Class: last line")
    failing_io: bool  # that error is I/O (the storage gate is closed for it)
    attempt_s: float | None  # how long the attempt running now has run (None: none runs, or in its backoff)


class RowFailed(Exception):
    """A row whose post-commit hooks raised an error that is not I/O, past its tries: never stored; its prompt is
    dead-lettered with ``error_class`` and ``reason`` (the error's last line) while its group's other rows commit."""

    def __init__(self, error_class: str, reason: str) -> None:
        super().__init__(f"{error_class}: {reason}")
        self.error_class, self.reason = error_class, reason
