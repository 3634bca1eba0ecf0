"""Shared pieces of the end-to-end worker tests: a simulator subprocess and a token-id job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from testing.datasets import kimi_id_prompt
from testing.fleet import free_port, register_id_job, wait_for_port, worker_env
from thinkfleet import kimi
from thinkfleet.broker.celery_app import send_tasks as _publish
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.settings import Settings


@contextmanager
def simulator(log_dir: Path, *args: str) -> Iterator[str]:
    """A real ``sglang-sim`` subprocess on a free port; yields its base URL."""
    port = free_port()
    log = open(log_dir / f"sim-{port}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_sim.cli", "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for_port(port, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


@dataclass
class IdJob:
    """A job submitted directly as token ids (no tokenizer): the worker tests' exact control."""

    name: str
    settings: Settings
    prompts: dict[str, list[int]]
    sampling_params: dict[str, object]
    #: The job record's generation (its messages carry it; :func:`republish` too).
    generation: str = ""

    @property
    def keys(self) -> Keys:
        return self.settings.keys


def make_prompts(n: int, seed: int = 0, length: int = 64) -> dict[str, list[int]]:
    """Kimi-shaped prompts: system/user turns of random ids, ending with <think>."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for i in range(n):
        body = rng.integers(100, 150_000, size=int(rng.integers(length // 2, length))).tolist()
        prompts[f"p{i:05d}"] = kimi_id_prompt(body)
    return prompts


def tokenizer_roots_for_tests() -> str:
    """Where the test tokenizers are built (``default_test_tokenizer_dir``'s parent): the directory a test worker
    loads a --turns all job's tokenizer from (``THINKFLEET_TOKENIZER_ROOTS``; the simulator serves no directory)."""
    from demo.tokenizer import default_test_tokenizer_dir

    return str(default_test_tokenizer_dir().parent)


def isolated_settings(redis_url: str, output_uri: str, **overrides: object) -> Settings:
    tag = uuid.uuid4().hex[:8]
    overrides.setdefault("tokenizer_roots", tokenizer_roots_for_tests())
    return Settings(redis_url=redis_url, output_uri=output_uri, key_prefix=f"t{tag}", queue=f"q{tag}", **overrides)


def submit_ids(
    settings: Settings, job: str, prompts: dict[str, list[int]], dataset: str = "synthetic", **sampling: object
) -> IdJob:
    """Write a job record + prompt hash the way the producer does, and publish one task per prompt."""
    id_job, tasks = register_ids(settings, job, prompts, dataset, **sampling)
    _publish(settings, tasks)
    return id_job


def register_ids(
    settings: Settings, job: str, prompts: dict[str, list[int]], dataset: str = "synthetic", **sampling: object
) -> tuple[IdJob, list[PromptTask]]:
    """Write a job record + prompt hash the way the producer does; returns the tasks, unpublished."""
    params: dict[str, object] = {
        "max_new_tokens": 2048,
        "temperature": 1.0,
        "top_p": 0.95,
        "stop_token_ids": list(kimi.DEFAULT_STOP_TOKEN_IDS),
        "sampling_seed": 7,
    }
    params.update(sampling)
    keys = settings.keys
    client = redis.Redis.from_url(settings.redis_url)
    from thinkfleet.signing import signer_for

    generation = register_id_job(
        client, keys, job, prompts, params, dataset, fingerprint="test-ids", signer=signer_for(settings)
    )
    tasks = [
        PromptTask(
            job=job,
            dataset=dataset,
            prompt_id=pid,
            row_index=i,
            content_hash=content_hash(ids),
            ids_blob=pack_ids(ids),
            generation=generation,
        )
        for i, (pid, ids) in enumerate(prompts.items())
    ]
    return IdJob(job, settings, prompts, params, generation), tasks


# -- reliability scenarios (tests/test_reliability_*.py) ------------------------------------------------
#: Worker settings that make faults cheap to recover from in tests: short lease, fast sweeps and retries.
FAST_WORKER = {
    "lease_s": 4,
    "reaper_interval_s": 1,
    "flush_interval_s": 0.2,
    "health_interval_s": 0.5,
    "retry_base_s": 0.05,
    "retry_max_backoff_s": 0.5,
    "request_timeout_floor_s": 5,
    "request_min_decode_tok_s": 2000,
    "shutdown_grace_s": 2,
    # Tests that count requests in flight want exactly the bound they set (tests/test_adaptive.py runs auto).
    "inflight_mode": "fixed",
}

#: For scenarios in which no worker dies, is paused or must lose its lease: a lease no stall of a busy box
#: outlasts (two workers starved 14-17 s on a loaded 2-core CI box let FAST_WORKER's 4 s lapse, and the other
#: worker then re-ran their prompts). Tests of lease expiry or of a killed worker's redelivery keep a short one.
STEADY_LEASE = {"lease_s": 60}

#: Where scenarios record their result rows (bench/reliability_report.py renders RELIABILITY.md).
RESULTS_ENV = "THINKFLEET_RELIABILITY_RESULTS"


def fast_env(settings: Settings, sim_url: str, **extra: object) -> dict[str, str]:
    """A worker subprocess environment for ``settings`` and ``sim_url`` with :data:`FAST_WORKER` values."""
    values: dict[str, object] = {"tokenizer_roots": tokenizer_roots_for_tests(), **FAST_WORKER, **extra}
    if settings.broker_url != settings.redis_url:
        values.setdefault("broker_url", settings.broker_url)
    return worker_env(
        settings.redis_url, sim_url, settings.output_uri, key_prefix=settings.key_prefix, queue=settings.queue, **values
    )


def post_json(url: str, payload: dict[str, object], timeout_s: float = 5.0) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def sim_stats(sim_url: str, rids: bool = False) -> dict[str, object]:
    """The simulator's call counts (``GET /control/stats``); ``rids=True`` adds every request id seen."""
    with urllib.request.urlopen(f"{sim_url}/control/stats?rids={int(rids)}", timeout=5) as resp:
        return json.loads(resp.read())


def worker_metrics(client: redis.Redis, keys: Keys, worker: str) -> str:
    """The Prometheus page of a running worker, found through the port its heartbeat record names."""
    port = json.loads(client.hget(keys.workers, worker))["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric_counter(text: str, name: str, label: str, value: str) -> float:
    """The value of counter ``name`` (``name_total``) in a Prometheus page where ``label`` is ``value``; 0 if absent."""
    match = re.search(rf'^{name}_total{{[^}}]*{label}="{re.escape(value)}"[^}}]*}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def cli_env(settings: Settings) -> dict[str, str]:
    """Environment that points the ``producer`` CLI at ``settings`` (flags are not needed then)."""
    env = dict(os.environ)
    env.update(
        {
            "THINKFLEET_REDIS_URL": settings.redis_url,
            "THINKFLEET_BROKER_URL": str(settings.broker_url),
            "THINKFLEET_OUTPUT_URI": settings.output_uri,
            "THINKFLEET_KEY_PREFIX": settings.key_prefix,
            "THINKFLEET_QUEUE": settings.queue,
        }
    )
    return env


def producer_cli(settings: Settings, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the real ``producer`` CLI (``python -m producer.cli``) against ``settings``."""
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


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
    """The after-every-scenario checks: ``producer verify`` (CLI) passes, every stored row's ids equal
    the simulator's deterministic output byte for byte, and ``producer status --json`` agrees with storage.

    ``overrides`` maps a prompt id to the sampling overrides of its winning revision (``producer retry``).
    """
    from sglang_sim.content import expected_generation
    from storage.reader import raw_duplicates, read_committed
    from thinkfleet.state.invariant import observable

    problems: list[str] = []
    verify = producer_cli(settings, "verify", job, "--json")
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

    status = producer_cli(settings, "status", job, "--json")
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
        _VERSION = os.environ.get(VERSION_ENV) or git_version(Path(__file__).resolve().parents[2])
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
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
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


def republish(job: IdJob, prompt_ids: list[str], dataset: str = "synthetic") -> None:
    """Publish another copy of these prompts' messages (a redelivery while the first may still run)."""
    order = {pid: i for i, pid in enumerate(job.prompts)}
    tasks = [
        PromptTask(
            job=job.name,
            dataset=dataset,
            prompt_id=pid,
            row_index=order[pid],
            content_hash=content_hash(job.prompts[pid]),
            ids_blob=pack_ids(job.prompts[pid]),
            generation=job.generation,
        )
        for pid in prompt_ids
    ]
    _publish(job.settings, tasks)


def transit_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` in any worker's transit list (popped, not yet recorded as unacked)."""
    from thinkfleet.state.invariant import prompt_of_task_id

    found: set[str] = set()
    for key in client.scan_iter(match=settings.keys.transit("") + "*"):
        for raw in client.lrange(key, 0, -1):
            pid = prompt_of_task_id(job, json.loads(raw)["headers"]["id"])
            if pid is not None:
                found.add(pid)
    return found
