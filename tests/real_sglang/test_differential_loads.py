"""The load endpoints the in-flight controller reads (workers/adaptive.py), real SGLang against the simulator's
profile of the same release: ``/v1/loads``, ``/get_load`` and the ``/metrics`` series, idle and while requests
run — status codes, the shape of every body (keys and JSON types), and what the worker's own load watcher
(:class:`~workers.adaptive.LoadWatcher`: its endpoint choice, fallbacks and parsers) reads from each server.

Differences the test finds are listed, with why they stay, in docs/sglang-versions.md (:data:`DOC_SECTION`);
it fails on one not listed there and on a listed one that no longer occurs, as the endpoint differential test
(test_real_sglang.py) does for the worker's other endpoints.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from real_server import VERSION, RealServer, get, post
from test_real_sglang import GREEDY, VOCAB, _context_length, differences, shape

from testing.fleet import wait_until
from testing.harness import make_prompts
from workers.adaptive import RETRACTIONS_METRIC, LoadSample, LoadWatcher, ResizableLimiter, inflight_watcher

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang-versions.md"
DOC_SECTION = f"## Measured: the load endpoints of the simulator's {VERSION} profile against a real {VERSION}"
#: Load endpoints as the watcher asks for them (and ``/v1/loads``'s narrowest ``include``).
LOAD_PATHS = (("v1_loads", "/v1/loads"), ("v1_loads_core", "/v1/loads?include=core"), ("get_load", "/get_load"))
#: Generations long enough to be running while the load is read (a CPU decodes ~100 tok/s per request).
BUSY = {**GREEDY, "max_new_tokens": 400, "ignore_eos": True}
BUSY_REQUESTS = 3


def documented_differences() -> set[str]:
    text = DOC.read_text()
    assert DOC_SECTION in text, f"{DOC} has no section {DOC_SECTION!r}"
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}


def metric_series(text: str) -> dict[str, bool]:
    """Per series the controller reads: is it declared (``# TYPE``), and has it a sample line."""
    family = RETRACTIONS_METRIC.removesuffix("_total")
    declared = re.search(rf"^# TYPE {re.escape(family)}(_total)? counter", text, re.M) is not None
    return {
        "declared": declared,
        "sampled": re.search(rf"^{re.escape(RETRACTIONS_METRIC)}[{{ ]", text, re.M) is not None,
    }


def read_loads(url: str) -> dict[str, tuple[int, Any]]:
    """name → (status, body) of each load endpoint and ``/metrics`` (JSON decoded; /metrics as text)."""
    out: dict[str, tuple[int, Any]] = {}
    for name, path in LOAD_PATHS:
        status, body = get(url + path, timeout_s=60)
        out[name] = (status, json.loads(body) if status == 200 else body.decode(errors="replace"))
    status, body = get(url + "/metrics", timeout_s=60)
    out["metrics"] = (status, body.decode(errors="replace"))
    return out


def busy(url: str, prompt: list[int], tag: str) -> list[threading.Thread]:
    """BUSY_REQUESTS long generations in flight (their rids ``tag-i``), aborted by the caller when read."""
    threads = []
    for i in range(BUSY_REQUESTS):
        payload = {"input_ids": prompt, "rid": f"{tag}-{i}", "sampling_params": BUSY}
        thread = threading.Thread(target=post, args=(url + "/generate", payload), kwargs={"timeout_s": 300})
        thread.start()
        threads.append(thread)
    return threads


class UrllibClient:
    """The ``get`` the watcher's wiring (:func:`~workers.adaptive.inflight_watcher`) expects of the worker's
    SGLang client: ``(status, body)``, here over urllib in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def get(self, path: str) -> tuple[int, bytes]:
        return await asyncio.to_thread(get, self.url + path, 60)


def controller_reads(url: str) -> LoadWatcher:
    """The worker's own load watcher over ``url`` (its endpoint choice, fallbacks and parsers)."""
    settings = SimpleNamespace(inflight_mode="auto", max_inflight=512, inflight_interval_s=5.0)
    watcher = inflight_watcher(settings, UrllibClient(url), ResizableLimiter(512), lambda: 0, lambda move: None)
    assert watcher is not None
    return watcher


def sample(watcher: LoadWatcher) -> LoadSample:
    read = asyncio.run(watcher.read())
    assert read is not None, "the watcher read no load"
    return read


def probe_loads(url: str, prompt: list[int], tag: str) -> dict[str, tuple[int, Any]]:
    """The load endpoints idle, then while BUSY_REQUESTS requests run: name → (status, skeleton of the body), and
    what the worker's watcher reads (``*_controller_reads``: counts as values, the KV as zero / positive)."""
    results: dict[str, tuple[int, Any]] = {}
    watcher = controller_reads(url)
    # Idle: nothing running (a request of an earlier probe may still be finishing its abort).
    wait_until(lambda: sample(watcher).running == 0, 120, 0.5, what="idle")
    for phase in ("idle", "busy"):
        threads = busy(url, prompt, tag) if phase == "busy" else []
        if threads:
            # All of them admitted (a CPU prefill takes a moment): the server reports them running.
            wait_until(lambda: sample(watcher).running >= BUSY_REQUESTS, 120, 0.2, what="the busy requests running")
        answers = read_loads(url)
        read = sample(watcher)
        for i in range(len(threads)):
            post(url + "/abort_request", {"rid": f"{tag}-{i}"})
        for thread in threads:
            thread.join(300)
        for name, (status, body) in answers.items():
            if status != 200:
                results[f"{phase}_{name}"] = (status, None)
            elif name == "metrics":
                results[f"{phase}_{name}"] = (status, metric_series(body))
            else:
                results[f"{phase}_{name}"] = (status, shape(body))
        used = "null" if read.used_tokens is None else ("positive" if read.used_tokens > 0 else "zero")
        reads = {"running": read.running, "waiting": read.waiting, "used_tokens": used}
        reads |= {"pool": read.max_total_tokens, "retractions": read.retractions_total}
        if phase == "busy":  # by now at least V1_LOADS_FAILURES reads: where the watcher reads from for good
            reads["from"] = watcher._load_path
        results[f"{phase}_controller_reads"] = (0, reads)
    return results


def test_differential_the_load_endpoints_the_controller_reads_answer_as_the_real_servers_do(
    real_sglang: RealServer, tmp_path: Path
) -> None:
    from sglang_sim.testing import SimulatorProcess

    context = _context_length(real_sglang)
    _, info = get(real_sglang.url + "/get_server_info")
    server_info = json.loads(info)
    assert server_info["version"] == VERSION, "THINKFLEET_REAL_SGLANG_VERSION names another release"
    model_path = json.loads(get(real_sglang.url + "/get_model_info")[1])["model_path"]
    # Given the simulator with the real server's flags (the tier's compose flags, its 64k-token KV pool) and a
    # time scale that keeps its requests running while the load is read
    sim = SimulatorProcess(
        "--sglang-version", VERSION, "--model-path", model_path, "--model-family", "kimi",
        "--context-length", str(context), "--no-report-context-length", "--vocab-size", str(VOCAB),
        "--time-scale", "2", "--health-min-s", "0.2", "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2",
        "--max-running-requests", "256", "--max-queued-requests", "512",
        "--kv-capacity-tokens", str(server_info["max_total_num_tokens"]),
    ).start()  # fmt: skip
    try:
        prompt = make_prompts(1, seed=23, length=40)["p00000"]
        # When both are read idle and while three requests run
        real = probe_loads(real_sglang.url, prompt, "load-real")
        simulated = probe_loads(sim.url, prompt, "load-sim")
    finally:
        sim.stop()
    # Then the worker's watcher reads the facts from the real server: 3 running when 3 run, KV in use, the pool,
    # none retracted…
    reads = real["busy_controller_reads"][1]
    assert reads["running"] == BUSY_REQUESTS and reads["waiting"] == 0, reads
    assert reads["used_tokens"] == "positive" and reads["pool"] == server_info["max_total_num_tokens"], reads
    assert reads["retractions"] == 0, reads
    # …and every status, body shape and watcher read that differs between the two is a documented difference
    found: set[str] = set()
    for name in real:
        (real_status, real_body), (sim_status, sim_body) = real[name], simulated[name]
        if real_status != sim_status:
            found.add(f"{name}: status real {real_status}, sim {sim_status}")
            continue  # (an error's body is no shape to compare)
        for line in differences(real_body, sim_body):
            found.add(f"{name}: {line}")
    documented = documented_differences()
    unexplained, stale = sorted(found - documented), sorted(documented - found)
    assert not unexplained, (
        "load-endpoint differences neither fixed in the simulator nor listed in docs/sglang-versions.md:\n"
        + "\n".join(unexplained)
    )
    assert not stale, "docs/sglang-versions.md lists load-endpoint differences that no longer occur:\n" + "\n".join(
        stale
    )
