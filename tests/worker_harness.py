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

from tests.conftest import free_port, wait_for_port
from thinkfleet import kimi
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.testing.datasets import kimi_id_prompt
from thinkfleet.testing.fleet import register_id_job, worker_env
from workers.retry import _publish


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


def isolated_settings(redis_url: str, output_uri: str, **overrides: object) -> Settings:
    tag = uuid.uuid4().hex[:8]
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
    register_id_job(client, keys, job, prompts, params, dataset, fingerprint="test-ids")
    tasks = [
        PromptTask(
            job=job, dataset=dataset, prompt_id=pid, row_index=i, content_hash=f"h-{pid}", ids_blob=pack_ids(ids)
        )
        for i, (pid, ids) in enumerate(prompts.items())
    ]
    return IdJob(job, settings, prompts, params), tasks


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
}

#: Where scenarios record their result rows (bench/reliability_report.py renders RELIABILITY.md).
RESULTS_ENV = "THINKFLEET_RELIABILITY_RESULTS"


def fast_env(settings: Settings, sim_url: str, **extra: object) -> dict[str, str]:
    """A worker subprocess environment for ``settings`` and ``sim_url`` with :data:`FAST_WORKER` values."""
    values: dict[str, object] = {**FAST_WORKER, **extra}
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

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.altered or self.problems) and self.verify_ok

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
    """Write one result row for RELIABILITY.md (only when ``THINKFLEET_RELIABILITY_RESULTS`` names a dir)."""
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
        "at": time.time(),
    }
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{scenario}-{broker}".lower()).strip("-")
    (path / f"{slug}.json").write_text(json.dumps(row, indent=2, sort_keys=True) + "\n")


def republish(job: IdJob, prompt_ids: list[str], dataset: str = "synthetic") -> None:
    """Publish another copy of these prompts' messages (a redelivery while the first may still run)."""
    order = {pid: i for i, pid in enumerate(job.prompts)}
    tasks = [
        PromptTask(
            job=job.name,
            dataset=dataset,
            prompt_id=pid,
            row_index=order[pid],
            content_hash=f"h-{pid}",
            ids_blob=pack_ids(job.prompts[pid]),
        )
        for pid in prompt_ids
    ]
    _publish(job.settings, tasks)


def transit_prompt_ids(client: redis.Redis, settings: Settings, job: str) -> set[str]:
    """Prompt ids of ``job`` in any worker's transit list (popped, not yet recorded as unacked)."""
    from producer.enqueue import prompt_of_task_id

    found: set[str] = set()
    for key in client.scan_iter(match=settings.keys.transit("") + "*"):
        for raw in client.lrange(key, 0, -1):
            pid = prompt_of_task_id(job, json.loads(raw)["headers"]["id"])
            if pid is not None:
                found.add(pid)
    return found
