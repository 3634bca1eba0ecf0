"""Worker subprocesses on this machine and their environment: what the demo (``python -m demo``) runs, the tests too.

Everything here starts real things — ``worker`` (a real ``celery worker``) as a subprocess — so a test can
SIGKILL or SIGTERM it exactly as an operator or a spot preemption would.

The demo package stands on the foundation only (``thinkfleet.keys`` and redis here; tests/test_architecture.py), and
the test-support package (``testing/fleet.py``, above every package) re-exports this beside the helpers only tests and
benchmarks use (waits, Redis counts, recovery timing).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import redis

from thinkfleet.keys import Keys


def free_port() -> int:
    """A TCP port nothing listens on right now (for a simulator, a Redis, a metrics server)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports nothing listens on right now: each picked while the others are still held, so two
    of them can never be the same one (n calls of :func:`free_port` can be, when nothing has bound it meanwhile)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    """Until something accepts connections on ``port``. The bound is generous: a start that takes 15 s on a busy
    2-core box is slow, not failed (the caller returns as soon as it listens)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def worker_env(
    redis_url: str,
    sglang_url: str,
    output_uri: str,
    max_inflight: int = 16,
    key_prefix: str = "tf",
    queue: str = "thinkfleet",
    **settings: object,
) -> dict[str, str]:
    """Environment for a worker subprocess: THINKFLEET_* from keyword settings (``lease_s=5`` …)."""
    env = dict(os.environ)
    values: dict[str, object] = {
        "redis_url": redis_url,
        "sglang_url": sglang_url,
        "output_uri": output_uri,
        "max_inflight": max_inflight,
        "key_prefix": key_prefix,
        "queue": queue,
        **settings,
    }
    for name, value in values.items():
        if value is not None:
            env[f"THINKFLEET_{name.upper()}"] = str(value)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class WorkerProcess:
    """One ``worker`` subprocess with a fixed identity; its log goes to ``log_path``."""

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        log_dir: Path,
        extra_args: tuple[str, ...] = (),
        log_name: str | None = None,
    ):
        self.name = name
        self.env = dict(env)
        #: ``log_name``: two processes under one ``name`` (twins) each keep their own log.
        self.log_path = Path(log_dir) / f"worker-{log_name or name}.log"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.started_at = 0.0
        self.log_offset = 0  # where this run's lines begin in the (appended) log

    def start(self) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 — owned by the child for its lifetime
        self.log_offset = log.tell()
        args = [sys.executable, "-m", "workers.cli", "--name", self.name, "--loglevel", "INFO", *self.extra_args]
        self.started_at = time.time()
        self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.starts += 1
        return self

    def wait_ready(self, client: redis.Redis, keys: Keys, timeout_s: float = 180.0) -> WorkerProcess:
        """Until this run's heartbeat is in Redis (its runtime started and Celery is consuming) — not the
        one a previous run under the same name left behind."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if self._beat_at(client, keys) >= self.started_at:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready after {timeout_s}s:\n{self.tail()}")

    def wait_consuming(self, timeout_s: float = 60.0) -> WorkerProcess:
        """Until this run has passed its server preflight and opened its health gate (it consumes from then
        on, until the gate closes). :meth:`wait_ready` returns earlier: the heartbeat starts before the
        preflight. A test that then stalls the server needs this one, or the preflight waits out the stall."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                if b"is healthy: consuming" in log.read():
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not consuming after {timeout_s}s:\n{self.tail()}")

    def _beat_at(self, client: redis.Redis, keys: Keys) -> float:
        raw = client.get(keys.heartbeat(self.name))
        try:
            beat = json.loads(raw) if raw else None
            if not beat or beat.get("starting") or (self.proc is not None and beat.get("pid") != self.proc.pid):
                return 0.0  # none, a run still starting (name held, runtime not built) or another process's
            return float(beat["at"])  # Redis's clock (workers/lease.py): this machine's, in tests
        except (ValueError, KeyError, TypeError, AttributeError):
            return float("inf")  # a heartbeat of another shape: present is all we can tell

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> bool:
        """The process is in state T (SIGSTOPped, e.g. by the failpoint action ``stop``), read from /proc."""
        if self.proc is None:
            return False
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def cont(self) -> None:
        """SIGCONT, if the process still exists (a test's cleanup after a pause)."""
        if self.alive() and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no cleanup at all (a host dying)."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (spot preemption) and wait for the warm shutdown."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def gate_closures(self) -> int:
        """How often the worker's health gate has closed so far (its log says "not consuming"): a test that
        restarts the server waits for this to grow, or a worker whose probes straddled a sub-second restart
        keeps what it read from the old server (its context length) — a real restart takes minutes."""
        try:
            return self.log_path.read_text(errors="replace").count("not consuming")
        except OSError:
            return 0
