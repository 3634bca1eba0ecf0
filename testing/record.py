"""The reliability record: what storage and the CLI say about a job after a scenario (:class:`Outcome`,
:func:`check_job`), and the row each end-to-end test writes of it — passed, failed with its live accounting, or
skipped with its reason — from which bench/reliability_report.py renders RELIABILITY.md.

Kept apart from testing/harness.py (the simulator, the id jobs and the CLI a scenario drives) because a scenario
uses the harness to *run* and this module to *judge and record*: the record's format follows RELIABILITY.md, the
harness follows the worker's and the producer's interfaces.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from testing.harness import IdJob, producer_cli
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings

#: Where scenarios record their result rows (bench/reliability_report.py renders RELIABILITY.md).
RESULTS_ENV = "THINKFLEET_RELIABILITY_RESULTS"


@dataclass
class Outcome:
    """What storage and the CLI say about a job after a scenario."""

    submitted: int
    stored: int
    dead: int
    lost: list[str]
    duplicated: list[str]
    altered: list[str]  # rows whose ids differ from the simulator's deterministic output
    verify_ok: bool
    status_agrees: bool
    problems: list[str]
    queued: int | None = None  # from the live accounting (failure rows; None = not measured)
    running: int | None = None
    error: str = ""  # why the scenario failed, when it did (a timeout, an assertion)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.altered or self.problems or self.error) and self.verify_ok

    @property
    def passed(self) -> bool:
        return self.clean and self.status_agrees

    def assert_clean(self) -> None:
        assert not self.lost, f"lost prompts: {self.lost[:10]}"
        assert not self.duplicated, f"duplicated prompts: {self.duplicated[:10]}"
        assert not self.altered, f"altered rows: {self.altered[:10]}"
        assert not self.problems, "\n".join(self.problems)
        assert self.verify_ok and self.status_agrees


def _u32(ids: object) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def check_job(
    settings: Settings,
    job: str,
    prompts: dict[str, list[int]],
    sampling_params: dict[str, object],
    expected_dead: set[str] = frozenset(),  # type: ignore[assignment]
    overrides: dict[str, dict[str, object]] | None = None,
) -> Outcome:
    """The after-every-scenario checks: ``producer verify`` passes, every stored row's ids equal
    the simulator's deterministic output byte for byte, and ``producer status --json`` agrees with storage.

    ``overrides`` maps a prompt id to the sampling overrides of its winning revision (``producer retry``).
    """
    from sglang_sim.content import expected_generation
    from storage.reader import raw_duplicates, read_committed
    from thinkfleet.state.invariant import observable

    problems: list[str] = []
    # verify and status in this process (click's runner): the same commands, without ≈ 3 CPU-s of interpreter and
    # imports per scenario on the 2-core CI box (none of these checks is about the CLI's process)
    verify = producer_cli(settings, "verify", job, "--json", in_process=True)
    try:
        report = json.loads(verify.stdout)
    except ValueError:
        report = {}
        problems.append(f"producer verify printed no JSON (rc {verify.returncode}): {verify.stderr[-2000:]}")
    verify_ok = verify.returncode == 0 and bool(report.get("ok"))
    if not verify_ok:
        problems.append(f"producer verify failed (rc {verify.returncode}): {json.dumps(report)[:3000]}")

    table = read_committed(settings.output_uri, job, columns=["prompt_id", "input_ids", "output_ids", "finish_reason"])
    rows = {r["prompt_id"]: r for r in table.to_pylist()}
    lost = sorted(set(prompts) - set(rows) - set(expected_dead))
    dup_table = raw_duplicates(settings.output_uri, job)
    duplicated = sorted(set(dup_table["prompt_id"].to_pylist())) if dup_table.num_rows else []
    altered = []
    for pid, row in rows.items():
        if pid not in prompts:
            problems.append(f"row for a prompt never submitted: {pid}")
            continue
        params = {**sampling_params, **(overrides or {}).get(pid, {})}
        want = expected_generation(prompts[pid], params)
        if _u32(row["input_ids"]) != _u32(prompts[pid]) or _u32(row["output_ids"]) != _u32(want.output_ids):
            altered.append(pid)
    stored_dead = sorted(set(rows) & set(expected_dead))
    if stored_dead:
        problems.append(f"prompts expected to be dead-lettered were stored: {stored_dead[:10]}")

    status = producer_cli(settings, "status", job, "--json", in_process=True)
    try:
        st = json.loads(status.stdout)
    except ValueError:
        st = {}
    want_status = {
        "total": len(prompts),
        "done": len(rows),
        "dead": len(expected_dead),
        "queued": 0,
        "running": 0,
        "unaccounted": 0 if observable(settings) else None,  # RabbitMQ's queue cannot be seen
        "finished": True,
    }
    got_status = {k: st.get(k) for k in want_status}
    status_agrees = got_status == want_status
    if not status_agrees:
        problems.append(f"producer status {got_status} disagrees with storage {want_status} (rc {status.returncode})")
    return Outcome(
        submitted=len(prompts),
        stored=len(rows),
        dead=len(expected_dead),
        lost=lost,
        duplicated=duplicated,
        altered=altered,
        verify_ok=verify_ok,
        status_agrees=status_agrees,
        problems=problems,
    )


def record_result(
    scenario: str,
    outcome: Outcome,
    faults: str,
    recovery_s: list[float | None] = (),  # type: ignore[assignment]
    wall_s: float | None = None,
    broker: str = "redis",
    workers: int = 1,
    ci: bool = True,
    notes: str = "",
) -> None:
    """Write one result row for RELIABILITY.md (only when ``THINKFLEET_RELIABILITY_RESULTS`` names a dir).

    Call it *before* asserting: the row says ``status`` "pass" or "fail" from the outcome itself, and
    if the test fails afterwards anyway (an assertion after this call, a timeout before it), the
    ``pytest_runtest_makereport`` hook in conftest.py turns the test's rows into failure rows
    (:func:`record_failure`) — so an old "0 lost" row never outlives a failing scenario.
    """
    out_dir = os.environ.get(RESULTS_ENV)
    if not out_dir:
        return
    row = {
        "scenario": scenario,
        "broker": broker,
        "workers": workers,
        "prompts": outcome.submitted,
        "stored": outcome.stored,
        "dead_lettered": outcome.dead,
        "faults": faults,
        "lost": len(outcome.lost),
        "duplicated": len(outcome.duplicated),
        "altered": len(outcome.altered),
        "verify_ok": outcome.verify_ok,
        "status_agrees": outcome.status_agrees,
        "recovery_s": [None if r is None else round(r, 2) for r in recovery_s],
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "ci": ci,
        "notes": notes,
        "status": "pass" if outcome.passed else "fail",
        "error": "" if outcome.passed else (outcome.error or _why(outcome)),
        "version": code_version(),
        "test": _current_test(),
        "at": time.time(),
    }
    slug = re.sub(r"[^a-z0-9]+", "-", f"{scenario}-{broker}".lower()).strip("-")
    _write_row(Path(out_dir), slug, row)


def _why(outcome: Outcome) -> str:
    """The failed checks of an outcome, in one line."""
    checks = (("lost", outcome.lost), ("duplicated", outcome.duplicated), ("altered", outcome.altered))
    parts = [f"{name} {len(ids)}: {ids[:5]}" for name, ids in checks if ids]
    if not outcome.verify_ok:
        parts.append("producer verify failed")
    if not outcome.status_agrees:
        parts.append("producer status disagreed with storage")
    return "; ".join(parts + outcome.problems)[:500]


def _write_row(out_dir: Path, slug: str, row: dict[str, object]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{slug}.json"
    test = row.get("test")
    if test:  # this test's earlier rows under another name (a renamed scenario, a failure row) go
        for old in _rows_of_test(out_dir, str(test)):
            if old != path and old not in _RECORDED.get(str(test), []):
                old.unlink(missing_ok=True)
        _RECORDED.setdefault(str(test), []).append(path)
    path.write_text(json.dumps(row, indent=2, sort_keys=True) + "\n")
    return path


#: Row files each test wrote in this process (test node id → paths).
_RECORDED: dict[str, list[Path]] = {}
#: Where ``bench/reliability_report.py --run`` keeps the previous run's rows while the suite runs.
PREVIOUS_DIR = "_previous"


def _current_test() -> str:
    """The running test's node id (pytest sets ``PYTEST_CURRENT_TEST`` = "nodeid (phase)")."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _rows_of_test(out_dir: Path, test: str) -> list[Path]:
    found = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            if json.loads(path.read_text()).get("test") == test:
                found.append(path)
        except (ValueError, OSError, AttributeError):
            continue
    return found


def code_version() -> str:
    """The tree the suite ran on: ``git rev-parse HEAD``, plus "-dirty" when ``git status --porcelain``
    lists anything; computed once per process (``bench/reliability_report.py --run`` passes its own)."""
    global _VERSION
    if _VERSION is None:
        _VERSION = os.environ.get(VERSION_ENV) or git_version(Path(__file__).resolve().parents[1])
    return _VERSION


def git_version(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "HEAD") or "unknown"
        return head + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


VERSION_ENV = "THINKFLEET_RELIABILITY_VERSION"
_VERSION: str | None = None


def record_failure(test: str, error: str, ci: bool = True, tb: object = None) -> None:
    """Called by conftest.py for a failed reliability test: the rows it wrote become failure rows; if it
    wrote none (it failed before :func:`record_result`, e.g. a ``wait_until`` timed out), a row named
    after its scenario in the previous results (else after the test) says FAIL with the counts Redis
    and storage hold now (the job is found from a live :class:`~testing.invariant_watch.InvariantWatch`,
    or an
    :class:`IdJob` in the failing test's frames)."""
    out_dir = os.environ.get(RESULTS_ENV)
    if not out_dir or test in _FAILED:
        return
    _FAILED.add(test)
    error = error.strip()[:500]
    root = Path(out_dir)
    mine = [p for p in _RECORDED.get(test, []) if p.exists()]
    if mine:
        for path in mine:
            row = json.loads(path.read_text())
            row.update(status="fail", error=row.get("error") or error)
            path.write_text(json.dumps(row, indent=2, sort_keys=True) + "\n")
        return
    previous = _rows_of_test(root, test) or _rows_of_test(root / PREVIOUS_DIR, test)
    base = json.loads(previous[0].read_text()) if previous else {}
    name = test.split("::", 1)[-1]
    found = _job_of_failure(test, tb)
    outcome = snapshot_outcome(*found, error=error) if found else None
    broker = base.get("broker") or ("rabbitmq" if found and _is_amqp(found[0]) else "redis")
    row = {
        "scenario": base.get("scenario") or name,
        "broker": broker,
        "workers": base.get("workers"),
        "faults": base.get("faults") or "",
        "recovery_s": [],
        "wall_s": None,
        "ci": ci,
        "notes": base.get("notes") or "",
        "prompts": outcome.submitted if outcome else None,
        "stored": outcome.stored if outcome else None,
        "dead_lettered": outcome.dead if outcome else None,
        "lost": len(outcome.lost) if outcome and outcome.queued is not None else None,  # None: not measured
        "duplicated": len(outcome.duplicated) if outcome else None,
        "altered": None,
        "queued": outcome.queued if outcome else None,
        "running": outcome.running if outcome else None,
        "verify_ok": False,
        "status_agrees": False,
        "status": "fail",
        "error": error,
        "version": code_version(),
        "test": test,
        "at": time.time(),
    }
    for path in previous:
        if path.parent == root:
            path.unlink(missing_ok=True)
    slug = previous[0].stem if previous else re.sub(r"[^a-z0-9]+", "-", f"{name}-{broker}".lower()).strip("-")
    _write_row(root, slug, row)


def record_skip(test: str, reason: str, ci: bool = True) -> None:
    """A skipped reliability test leaves a SKIP row (its scenario did not run: no evidence either way)."""
    out_dir = os.environ.get(RESULTS_ENV)
    if not out_dir:
        return
    root = Path(out_dir)
    previous = _rows_of_test(root, test) or _rows_of_test(root / PREVIOUS_DIR, test)
    base = json.loads(previous[0].read_text()) if previous else {}
    name = test.split("::", 1)[-1]
    broker = base.get("broker") or ("rabbitmq" if "rabbitmq" in test else "redis")
    row = {
        **{k: None for k in ("workers", "prompts", "stored", "dead_lettered", "lost", "duplicated", "altered")},
        "scenario": base.get("scenario") or name,
        "broker": broker,
        "faults": base.get("faults") or "",
        "recovery_s": [],
        "wall_s": None,
        "ci": ci,
        "notes": base.get("notes") or "",
        "verify_ok": False,
        "status_agrees": False,
        "status": "skip",
        "error": reason.strip()[:500],
        "version": code_version(),
        "test": test,
        "at": time.time(),
    }
    slug = previous[0].stem if previous else re.sub(r"[^a-z0-9]+", "-", f"{name}-{broker}".lower()).strip("-")
    _write_row(root, slug, row)


_FAILED: set[str] = set()


def _is_amqp(settings: Settings) -> bool:
    return str(settings.broker_url).startswith("amqp")


def _job_of_failure(test: str, tb: object) -> tuple[Settings, str, set[str] | None] | None:
    """The job a failed test was running: its live InvariantWatch's, else an IdJob in its frames."""
    from testing import invariant_watch as invariant

    watch = invariant.current
    if watch is not None and watch.test == test:
        return watch.settings, watch.job, None
    while tb is not None:
        for value in reversed(list(getattr(tb, "tb_frame").f_locals.values())):  # noqa: B009
            if isinstance(value, IdJob):
                return value.settings, value.name, set(value.prompts)
        tb = getattr(tb, "tb_next")  # noqa: B009
    return None


def snapshot_outcome(settings: Settings, job: str, prompts: set[str] | None = None, error: str = "") -> Outcome:
    """What Redis and storage hold for ``job`` now, for a scenario that did not get to :func:`check_job`:
    lost = unaccounted by the live invariant (in no place at all), plus queued and running."""
    from thinkfleet.state.invariant import NotObservable, account

    problems: list[str] = []
    client = sync_client(settings.redis_url, timeout_s=10)
    submitted, done, dead, queued, running = set(prompts or ()), set(), set(), None, None
    lost: list[str] = []
    try:
        acc = account(client, settings, job, submitted=set(prompts) if prompts else None)
        submitted, done, dead = acc.submitted, acc.done, acc.dead
        counts = acc.counts()
        queued, running, lost = counts["queued"], counts["running"], sorted(acc.unaccounted)
    except NotObservable:
        done = {m.decode() for m in client.smembers(settings.keys.done(job))}
        dead = {k.decode() for k in client.hkeys(settings.keys.dead(job))}
    except redis.RedisError as exc:
        problems.append(f"Redis unreachable for the failure snapshot: {exc}")
    finally:
        client.close()
    stored, duplicated = done, []
    try:
        from storage.reader import raw_duplicates, read_committed

        table = read_committed(settings.output_uri, job, columns=["prompt_id"])
        stored = set(table["prompt_id"].to_pylist())
        dups = raw_duplicates(settings.output_uri, job)
        duplicated = sorted(set(dups["prompt_id"].to_pylist())) if dups.num_rows else []
    except Exception as exc:  # storage may hold nothing yet
        problems.append(f"storage unreadable for the failure snapshot: {exc}")
    return Outcome(
        submitted=len(submitted),
        stored=len(stored & submitted) if submitted else len(stored),
        dead=len(dead),
        lost=lost,
        duplicated=duplicated,
        altered=[],
        verify_ok=False,
        status_agrees=False,
        problems=problems,
        queued=queued,
        running=running,
        error=error,
    )
