"""The live invariant, sampled during a fault scenario: every submitted prompt is always somewhere.

    watch = InvariantWatch(settings, "kill3").start()     # or: with InvariantWatch(...) as watch:
    ...                                                    # kill workers, restart servers, …
    watch.stop()
    watch.assert_held()

A background thread checks ``thinkfleet.state.invariant.account`` every ``interval_s`` with its own
client. ``account`` already re-checks a prompt it found nowhere; a violation counts only when the same
prompt is unaccounted on two consecutive successful samples (a Redis error breaks the chain, so a
restart in the middle of a scenario is not a violation — but a prompt still missing afterwards is).

A Redis that comes back from an older snapshot (its ``run_id`` changed) really has lost where some prompts are:
only the workers that finished them know, until their next check finds their own finalize marks older than
their latest finalize (``Ledger.lost_finalizes``, every ``lease_s / 4``) and finalizes them again. For
``restart_grace_s`` after such a restart (default: three leases) a prompt unaccounted is *excused* (counted in
:attr:`excused`), not a violation; one still unaccounted after that is.

Each sample also checks the counters ``producer status`` reads (:func:`thinkfleet.state.counters.check_counters`,
no repair) against the sets: a drift seen on two consecutive samples during which nothing moved fails too.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import redis

from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.counters import check_counters
from thinkfleet.state.invariant import account, broker_client

#: The watch of the test now running (the failure hook in conftest.py reads its last counts).
current: InvariantWatch | None = None


@dataclass
class Violation:
    prompt_ids: list[str]
    first_seen: float  # time.time() of the first of the two samples
    confirmed: float  # … and of the second


@dataclass
class InvariantWatch:
    settings: Settings
    job: str
    interval_s: float = 0.5
    violations: list[Violation] = field(default_factory=list)
    samples: int = 0
    errors: int = 0
    last_error: str = ""
    last_counts: dict[str, int] = field(default_factory=dict)
    #: counter drifts (dataset → {field: counter − set}) seen on two consecutive samples with nothing moving
    counter_drifts: list[dict[str, dict[str, int]]] = field(default_factory=list)
    _drift: dict[str, dict[str, int]] | None = field(default=None, repr=False)
    test: str = ""  # the pytest node id that started it
    crashed: str = ""  # what ended the sampling thread other than stop() (assert_held fails on it)
    restart_grace_s: float | None = None  # None: 3 × lease_s
    excused: set[str] = field(default_factory=set)  # unaccounted only within the grace after a Redis restart
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> InvariantWatch:
        global current
        current = self
        self.test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        self._thread = threading.Thread(target=self._run, name=f"invariant-{self.job}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> InvariantWatch:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return self

    def __enter__(self) -> InvariantWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def sample(self, client: redis.Redis, broker: redis.Redis) -> set[str]:
        acc = account(client, self.settings, self.job, broker=broker)
        self.samples += 1
        self.last_counts = acc.counts()
        checked = check_counters(client, self.settings.keys, self.job, repair=False)
        if not checked.moving:
            if checked.drift and checked.drift == self._drift:
                self.counter_drifts.append(checked.drift)
            self._drift = checked.drift
        return acc.unaccounted

    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        except Exception as exc:  # a watch that stopped sampling must not pass as one that held
            self.crashed = f"{type(exc).__name__}: {exc}"
            raise

    def _sample_until_stopped(self) -> None:
        client = sync_client(self.settings.redis_url, timeout_s=10)
        broker = broker_client(client, self.settings)
        previous: tuple[float, set[str]] | None = None
        grace = self.restart_grace_s if self.restart_grace_s is not None else 3 * self.settings.lease_s
        run_id: str | None = None
        grace_until = 0.0
        try:
            while not self._stop.is_set():
                at = time.time()
                try:
                    server = self._run_id(client)
                    if run_id is not None and server is not None and server != run_id:
                        grace_until = at + grace  # a restarted Redis: maybe from an older snapshot
                    run_id = server
                    missing = self.sample(client, broker)
                except redis.RedisError as exc:  # Redis restarting: no sample, and no chain across the gap
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    previous = None
                else:
                    if previous is not None:
                        persisting = missing & previous[1]
                        if persisting and at < grace_until:
                            self.excused |= persisting
                        elif persisting:
                            self.violations.append(Violation(sorted(persisting), previous[0], at))
                    previous = (at, missing)
                self._stop.wait(self.interval_s)
        finally:
            client.close()
            if broker is not client:
                broker.close()

    @staticmethod
    def _run_id(client: redis.Redis) -> str | None:
        """The server's ``run_id`` (new at every start); None where this user may not run INFO (an ACL user)."""
        try:
            return str(client.info("server").get("run_id", ""))
        except redis.ResponseError:
            return None

    @property
    def lost(self) -> set[str]:
        """Every prompt ever confirmed unaccounted."""
        return set().union(*(v.prompt_ids for v in self.violations)) if self.violations else set()

    def assert_held(self) -> None:
        assert self.samples > 0, f"the invariant was never sampled ({self.errors} errors, last: {self.last_error})"
        assert not self.crashed, f"the watch of {self.job!r} died after {self.samples} samples: {self.crashed}"
        assert not self.counter_drifts, (
            f"the counters of job {self.job!r} disagree with its sets (counter − set, per dataset): "
            f"{self.counter_drifts[0]} ({len(self.counter_drifts)} sample(s))"
        )
        if self.violations:
            first = self.violations[0]
            raise AssertionError(
                f"invariant total = done + dead + queued + running violated for job {self.job!r}: "
                f"{len(self.lost)} prompt(s) unaccounted on consecutive samples, e.g. {sorted(self.lost)[:10]}; "
                f"first at {time.strftime('%H:%M:%S', time.localtime(first.first_seen))} "
                f"({len(self.violations)} violating sample(s) of {self.samples})"
            )
