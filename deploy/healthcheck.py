"""A container healthcheck that also restarts the container when it stays unhealthy.

Docker marks a container whose healthcheck keeps failing "unhealthy" and then does nothing about it:
``restart: unless-stopped`` acts only when the main process exits. So this probe counts consecutive
failures (in a small state file) and, after ``--restart-after`` of them, makes the container exit:

- SIGTERM to PID 1 (the compose services run ``init: true``, so PID 1 is tini, which forwards it: the
  worker drains and hands its prompts back, SGLang shuts down) — the restart policy starts a fresh one;
- two probes later, if the container is still there, SIGKILL to every process but PID 1 (tini exits
  with its child).

Failures count only once the service was healthy at least once, so a model still loading (SGLang's
long ``start_period``) is never killed; the counter belongs to one run of the container (it starts over
when PID 1 is a new process, i.e. after the restart). It signals PID 1 only inside a container (``/.dockerenv`` or
``/run/.containerenv``); ``--pid`` names another process (tests). Standard library only: it runs in
the thinkfleet image and, bind-mounted, in the SGLang image.

    python healthcheck.py URL [--timeout S] [--restart-after N] [--pid PID] [--state FILE]

Exit status 0 when URL answers 2xx within the timeout, else 1 (what Docker's healthcheck reads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import urllib.request
from pathlib import Path

#: Probes after the SIGTERM before everything but PID 1 is SIGKILLed.
KILL_AFTER_EXTRA = 2


def in_container() -> bool:
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


def probe(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read(1024)
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except Exception as exc:  # any failure is a failed probe: refused, timeout, HTTP error
        return f"{type(exc).__name__}: {exc}"


def started(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); 0 if unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def load(path: Path, run: int) -> dict[str, int]:
    """The counter of this run of the container (a restarted container starts from zero)."""
    fresh = {"run": run, "healthy_once": 0, "failures": 0}
    try:
        state = json.loads(path.read_text())
        if int(state.get("run", -1)) != run:
            return fresh
        return {"run": run, "healthy_once": int(state["healthy_once"]), "failures": int(state["failures"])}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return fresh


def save(path: Path, state: dict[str, int]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def restart(pid: int, failures: int, restart_after: int) -> str:
    """Signal the container to exit; returns what was done."""
    if pid == 1 and not in_container():
        return "not in a container: PID 1 left alone"
    try:
        if failures < restart_after + KILL_AFTER_EXTRA:
            os.kill(pid, signal.SIGTERM)
            return f"SIGTERM to PID {pid}"
        if pid == 1:
            os.kill(-1, signal.SIGKILL)  # every process but PID 1 and this one
            return "SIGKILL to every process but PID 1"
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL to PID {pid}"
    except OSError as exc:
        return f"cannot signal PID {pid}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=10.0, help="Seconds the URL may take (default 10).")
    parser.add_argument(
        "--restart-after", type=int, default=0, help="Consecutive failures that make the container exit; 0: never."
    )
    parser.add_argument("--pid", type=int, default=1, help="Process to stop (default 1: the container's init).")
    parser.add_argument("--state", type=Path, help="Failure counter file (default: in the temp directory).")
    args = parser.parse_args(argv)
    state_path = args.state or Path(tempfile.gettempdir()) / (
        "thinkfleet-health-" + hashlib.sha256(args.url.encode()).hexdigest()[:12] + ".json"
    )
    run = started(args.pid)
    state = load(state_path, run)
    error = probe(args.url, args.timeout)
    if error is None:
        save(state_path, {"run": run, "healthy_once": 1, "failures": 0})
        return 0
    if state["healthy_once"]:
        state["failures"] += 1
    save(state_path, state)
    message = f"unhealthy: {args.url}: {error}"
    if state["healthy_once"]:
        message += f" ({state['failures']} in a row)"
        if args.restart_after > 0 and state["failures"] >= args.restart_after:
            message += "; restarting: " + restart(args.pid, state["failures"], args.restart_after)
    else:
        message += " (not healthy yet since start: not counted)"
    print(message, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
