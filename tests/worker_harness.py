"""Shared pieces of the end-to-end worker tests: a simulator subprocess and a token-id job."""

from __future__ import annotations

import json
import subprocess
import sys
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
        prompts[f"p{i:05d}"] = [
            kimi.IM_SYSTEM,
            1,
            kimi.IM_MIDDLE,
            2,
            kimi.IM_END,
            kimi.IM_USER,
            3,
            kimi.IM_MIDDLE,
            *body,
            kimi.IM_END,
            kimi.IM_ASSISTANT,
            4,
            kimi.IM_MIDDLE,
            kimi.THINK_START,
        ]
    return prompts


def isolated_settings(redis_url: str, output_uri: str, **overrides: object) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(redis_url=redis_url, output_uri=output_uri, key_prefix=f"t{tag}", queue=f"q{tag}", **overrides)


def submit_ids(
    settings: Settings, job: str, prompts: dict[str, list[int]], dataset: str = "synthetic", **sampling: object
) -> IdJob:
    """Write a job record + prompt hash the way the producer does, and publish one task per prompt."""
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
    record = {
        "name": job,
        "sampling_params": params,
        "tokenizer_fingerprint": "test-ids",
        "chat_template_hash": "test-ids",
        "think_start_id": kimi.THINK_START,
        "think_end_id": kimi.THINK_END,
    }
    client.hset(keys.job(job), mapping={k: json.dumps(v) for k, v in record.items()})
    client.sadd(keys.jobs, job)
    client.hset(keys.prompts(job), mapping={pid: f"h-{pid}" for pid in prompts})
    client.hset(keys.prompt_dataset(job), mapping=dict.fromkeys(prompts, dataset))
    tasks = [
        PromptTask(
            job=job, dataset=dataset, prompt_id=pid, row_index=i, content_hash=f"h-{pid}", ids_blob=pack_ids(ids)
        )
        for i, (pid, ids) in enumerate(prompts.items())
    ]
    _publish(settings, tasks)
    return IdJob(job, settings, prompts, params)
