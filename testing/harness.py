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
from thinkfleet.redis_client import sync_client
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
        # Until it listens (a start that loads a tokenizer and a tool catalogue took > 30 s on a loaded 2-core box);
        # a simulator that exited fails at once, naming its log.
        deadline = time.monotonic() + 180
        while True:
            try:
                wait_for_port(port, 1)
                break
            except TimeoutError:
                if proc.poll() is not None:
                    raise RuntimeError(f"sglang-sim exited with {proc.returncode}: see {log.name}") from None
                if time.monotonic() > deadline:
                    raise
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
    client = sync_client(settings.redis_url)
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


def producer_cli(
    settings: Settings, *args: str, timeout_s: float = 120.0, in_process: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the real ``producer`` CLI (``python -m producer.cli``) against ``settings``.

    ``in_process``: the same command through click's runner in this process (:func:`producer_cli_in_process`), for
    a test whose subject is not the process — a status poll, a query between steps. A new interpreter costs
    ≈ 1.5 CPU-s of imports per call (≈ 4 with a tokenizer) on the 2-core CI box; in-process, once per test process.
    """
    if in_process:
        return producer_cli_in_process(settings, *args)
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def producer_cli_in_process(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """:func:`producer_cli` in this process: the same command group, arguments and ``THINKFLEET_*`` environment,
    through click's runner; its exit code, stdout and stderr come back as a subprocess' would (an uncaught
    exception: exit 1, its traceback on stderr, as the interpreter prints it). No timeout: pytest-timeout's is."""
    import traceback

    from click.testing import CliRunner

    from producer.cli import cli

    env = {k: v for k, v in cli_env(settings).items() if k.startswith("THINKFLEET_")}
    result = CliRunner().invoke(cli, list(args), env=env, prog_name="producer")
    stderr = result.stderr
    if result.exc_info is not None and result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(["producer", *args], result.exit_code, result.stdout, stderr)


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
