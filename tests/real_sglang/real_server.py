"""A real SGLang server for the real-SGLang tier: built, started, killed and restarted as a test needs.

The environment and the model come from ``scripts/real_sglang.sh`` (its lock file, its stand-ins, its model
builder); this module only runs them. ``THINKFLEET_REAL_SGLANG_VERSION`` picks the release (0.5.9, the deployed
one, by default; 0.5.23, the current one). ``THINKFLEET_REAL_SGLANG_URL`` points the tier at a server someone
else runs (a GPU host): then nothing is built, and the tests that kill or restart the server skip, saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from testing.fleet import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "real_sglang.sh"
#: Weights loading, then the warm-up forward: 45–90 s on a quiet 2-core box. Far more under load.
START_TIMEOUT_S = float(os.environ.get("THINKFLEET_REAL_SGLANG_START_S", "600"))
#: The release the tier runs (a lock file scripts/real_sglang/sglang-VERSION.lock) and compares the simulator's
#: profile of that release with.
VERSION = os.environ.get("THINKFLEET_REAL_SGLANG_VERSION", "0.5.9")


#: The flags docker-compose.yml gives SGLang that a CPU server takes too (not --tp or --trust-remote-code).
COMPOSE_FLAGS = (
    "--reasoning-parser kimi_k2",
    "--tool-call-parser kimi_k2",
    "--max-running-requests 256",
    "--max-queued-requests 512",
    "--enable-metrics",
    "--log-level warning",
    # not the compose file's: the scheduler sleeps between requests instead of spinning on a core the rest of
    # the suite needs
    "--sleep-on-idle",
)


class EnvironmentBroken(RuntimeError):
    """The real-SGLang venv or model could not be built: the tier fails (never skips) with the build's output."""


def _run_script(*args: str, timeout_s: float = 1800, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise EnvironmentBroken(
            f"scripts/real_sglang.sh {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
        )
    return proc.stdout.strip().splitlines()[-1]


def ensure_environment() -> Path:
    """The real-SGLang venv's python (built once per lock file; minutes the first time)."""
    return Path(_run_script("env", VERSION))


def ensure_vision_environment() -> Path:
    """The python of the venv's vision overlay (real torchvision, a decord stand-in: scripts/real_sglang.sh
    vision-env), built once per lock file and overlay (the venv first, then ≈ 20 s)."""
    return Path(_run_script("vision-env", VERSION))


def ensure_model(tokenizer: Path, cache: Path, arch: str = "qwen2", vocab_size: int | None = None) -> Path:
    """A tiny random-weight model around ``tokenizer``, cached on the tokenizer's and the builder's content."""
    digest = hashlib.sha256()
    for path in sorted(tokenizer.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update((ROOT / "scripts" / "real_sglang" / "make_model.py").read_bytes())
    digest.update(f"{arch}/{vocab_size}".encode())
    if VERSION != "0.5.9":  # built by that release's transformers (0.5.9's key as it always was)
        digest.update(VERSION.encode())
    out = cache / f"real-sglang-model-{tokenizer.name}-{arch}-{digest.hexdigest()[:12]}"
    if not (out / ".complete").exists():
        args = ("model", str(tokenizer), str(out), arch, *([str(vocab_size)] if vocab_size else []))
        _run_script(*args, env={**os.environ, "THINKFLEET_REAL_SGLANG_VERSION": VERSION})
    return out


def get(url: str, timeout_s: float = 10) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def post(url: str, payload: object, timeout_s: float = 300) -> tuple[int, object]:
    """(status, decoded JSON body or raw text) of a POST of ``payload`` as JSON."""
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode(errors="replace")


@dataclass
class RealServer:
    """One ``sglang.launch_server`` process group on a free port (or an external server, ``external``)."""

    model: Path | None
    log_path: Path
    port: int = field(default_factory=free_port)
    external: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    #: (seconds since start, /health_generate status) until the first 200, per start: the health timeline
    starts: list[list[tuple[float, int]]] = field(default_factory=list)
    #: The server flags beyond the script's CPU ones (the compose file's, by default).
    flags: tuple[str, ...] = COMPOSE_FLAGS

    @property
    def url(self) -> str:
        return self.external or f"http://127.0.0.1:{self.port}"

    @property
    def restartable(self) -> bool:
        return self.external is None

    def start(self, wait: bool = True) -> RealServer:
        if self.external is None:
            assert self.model is not None
            log = open(self.log_path, "ab")  # noqa: SIM115 — the child keeps it
            env = {**os.environ, "THINKFLEET_REAL_SGLANG_ARGS": " ".join(self.flags)}
            self.proc = subprocess.Popen(
                ["bash", str(SCRIPT), "serve", str(self.model), str(self.port), VERSION],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: scheduler and detokenizer die with it
                env=env,
            )
            log.close()
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        timeline: list[tuple[float, int]] = []
        self.starts.append(timeline)
        started = time.monotonic()
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.proc is not None and self.proc.poll() is not None:
                raise EnvironmentBroken(f"the SGLang server exited (rc {self.proc.returncode}):\n{self.tail()}")
            status, _ = get(self.url + "/health_generate", timeout_s=30)
            timeline.append((round(time.monotonic() - started, 2), status))
            if status == 200:
                return
            time.sleep(0.5)
        raise EnvironmentBroken(f"no healthy SGLang at {self.url} within {START_TIMEOUT_S:.0f}s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole group: a crashed server (or a host that lost power)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus series over the samples whose labels include ``labels``, from ``/metrics``
        (``--enable-metrics``, as the compose file runs it)."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = get(self.url + "/metrics")
        assert status == 200, f"/metrics answered {status}"
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def generate(self, payload: dict[str, object], timeout_s: float = 300) -> tuple[int, object]:
        return post(self.url + "/generate", payload, timeout_s)
