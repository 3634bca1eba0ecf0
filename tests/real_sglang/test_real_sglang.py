"""The real-SGLang tier: the worker, the CLI and the simulator against a real ``sglang==0.5.9`` server (the
deployed release), or ``sglang==0.5.23`` (the current one) with ``THINKFLEET_REAL_SGLANG_VERSION=0.5.23``.

One server for the tier (``conftest.py``): a tiny random-weight model with the Kimi test tokenizer's real ids
and vocabulary (163,840), on this CPU. What it proves: the wire protocol, health, abort, refusals and the
exactly-once trip against the real thing, and where the simulator's profile of that release differs from it.
What it cannot: GPU kernels, a real model's reasoning, real throughput (docs/real-sglang.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from real_server import VERSION, RealServer, get, post

from storage.reader import raw_duplicates, read_committed
from testing.fleet import WorkerProcess, dead_letters, job_progress, job_settled, wait_until
from testing.harness import _publish as publish
from testing.harness import cli_env, fast_env, isolated_settings, make_prompts, producer_cli, register_ids
from thinkfleet import kimi

#: The first test also waits for the venv (built once per lock file: minutes) and the server (a minute or more).
pytestmark = pytest.mark.timeout(1800)

VOCAB = kimi.VOCAB_SIZE
#: Short generations: CPU decode of a 10 M-parameter model is ~100 tok/s per request.
MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "top_p": 1.0}
#: The real server is slower than the simulator and a loaded CI box slower still: leases and request
#: deadlines that no stall outlasts (the tier tests the protocol, not lease expiry).
REAL_WORKER = {
    "lease_s": 60,
    "request_timeout_floor_s": 300,
    "request_min_decode_tok_s": 1,
    "health_interval_s": 1,
}


def submit(settings: Any, job: str, prompts: dict[str, list[int]], **sampling: Any) -> Any:
    """The job as ``producer submit`` writes it for this model: its record carries the vocabulary (from the
    model's config.json, as submit reads it), which no SGLang endpoint reports — without it the worker cannot
    refuse an out-of-vocabulary id, and one such id kills the whole 0.5.9 server (an IndexError in the
    embedding takes the scheduler down)."""
    id_job, tasks = register_ids(settings, job, prompts, **sampling)
    client = redis.Redis.from_url(settings.redis_url)
    fields = {"vocab_size": VOCAB, "vocab_source": "config.json of the tier's model"}
    client.hset(settings.keys.job(job), mapping={k: json.dumps(v) for k, v in fields.items()})
    publish(settings, tasks)
    return id_job


def _worker(name: str, settings: Any, server: RealServer, tmp_path: Path, inflight: int = 8) -> WorkerProcess:
    env = fast_env(settings, server.url, max_inflight=inflight, **REAL_WORKER)
    return WorkerProcess(name, env, tmp_path)


def replay(server: RealServer, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """The server's own answers to ``prompts`` (one batched /generate), in order."""
    status, body = server.generate({"input_ids": prompts, "sampling_params": sampling}, timeout_s=600)
    assert status == 200, f"/generate answered {status}: {body}"
    assert isinstance(body, list) and len(body) == len(prompts)
    return body


def _check_stored_as_served(settings: Any, job: str, prompts: dict[str, list[int]], server: RealServer) -> list[dict]:
    """Exactly once, ``producer verify`` OK, and every row's output what the server answers at temperature 0."""
    # A random-weight model never closes reasoning: verify's reasoning alarm (the seed's bug detector) must fire…
    # (from 40 rows: these jobs are 48 and 60 prompts, under the alarm's default of 100 rows)
    alarm_env = {**cli_env(settings), "THINKFLEET_ALARM_MIN_ROWS": "40"}
    cmd = [sys.executable, "-m", "producer.cli", "verify", job, "--json"]
    alarmed = json.loads(subprocess.run(cmd, env=alarm_env, capture_output=True, text=True).stdout)
    assert alarmed["reasoning_alarm"] and alarmed["think_end_rows"] == 0, alarmed
    # …and with the alarm set aside, everything else verify checks passes.
    env = {**cli_env(settings), "THINKFLEET_ALARM_MIN_ROWS": str(10**9)}
    verify = subprocess.run(
        [sys.executable, "-m", "producer.cli", "verify", job, "--json"], env=env, capture_output=True, text=True
    )
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout[-3000:] + verify.stderr[-2000:]
    cols = ["prompt_id", "input_ids", "output_ids", "completion_tokens", "finish_reason", "deterministic"]
    rows = read_committed(settings.output_uri, job, columns=cols).to_pylist()
    assert sorted(r["prompt_id"] for r in rows) == sorted(prompts), "lost or foreign rows"
    assert raw_duplicates(settings.output_uri, job).num_rows == 0
    answers = replay(
        server, [prompts[r["prompt_id"]] for r in rows], {**GREEDY, "stop_token_ids": list(kimi.DEFAULT_STOP_TOKEN_IDS)}
    )
    for row, answer in zip(rows, answers, strict=True):
        pid = row["prompt_id"]
        assert list(row["input_ids"]) == prompts[pid]
        assert list(row["output_ids"]) == answer["output_ids"], f"{pid}: stored ids differ from the server's replay"
        assert row["completion_tokens"] == len(row["output_ids"]) == answer["meta_info"]["completion_tokens"]
        assert row["finish_reason"] == answer["meta_info"]["finish_reason"]["type"], pid
    return rows


# -- the worker end to end ---------------------------------------------------------------------------------
def test_a_job_is_stored_exactly_once_as_the_server_answers_it(
    real_sglang: RealServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a job of 48 prompts with a sampling seed, on a server without deterministic inference (enough to fill
    # the worker's in-flight bound many times over; every prompt is asked again below, so each one costs twice).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(48, seed=3, length=48)
    worker = _worker("real-1", settings, real_sglang, tmp_path).start()
    try:
        worker.wait_ready(client, settings.keys, timeout_s=120)
        job = submit(settings, "real", prompts, **GREEDY)
        # When one worker runs it against the real server.
        wait_until(lambda: job_settled(client, settings, "real", len(prompts)), 900, 1, what="the job settled")
    finally:
        worker.terminate()
    # Then each prompt is stored once, with what the server answers when asked again (greedy is deterministic).
    rows = _check_stored_as_served(settings, "real", job.prompts, real_sglang)
    # …and the seed is recorded as not honoured (0.5.9 and 0.5.23 read sampling_seed only with deterministic
    # inference).
    assert {r["deterministic"] for r in rows} == {False}


def test_logprobs_come_back_aligned_with_the_output(real_sglang: RealServer, redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(12, seed=5, length=32)
    worker = _worker("real-lp", settings, real_sglang, tmp_path).start()
    try:
        worker.wait_ready(client, settings.keys, timeout_s=120)
        submit(settings, "lp", prompts, logprobs=3, **GREEDY)
        wait_until(lambda: job_settled(client, settings, "lp", len(prompts)), 600, 1, what="the job settled")
    finally:
        worker.terminate()
    cols = ["prompt_id", "output_ids", "output_logprobs", "top_logprob_ids", "top_logprobs"]
    rows = read_committed(settings.output_uri, "lp", columns=cols).to_pylist()
    assert len(rows) == len(prompts)
    for row in rows:
        n = len(row["output_ids"])
        assert len(row["output_logprobs"]) == n and len(row["top_logprob_ids"]) == n and len(row["top_logprobs"]) == n
        assert all(len(top) == 3 for top in row["top_logprob_ids"])
        # greedy: the chosen id is the most likely one
        assert [top[0] for top in row["top_logprob_ids"]] == list(row["output_ids"])


# -- faults ------------------------------------------------------------------------------------------------
def test_server_and_worker_killed_mid_job_lose_and_duplicate_nothing(
    real_sglang: RealServer, redis_url: str, tmp_path: Path
) -> None:
    if not real_sglang.restartable:
        pytest.skip("THINKFLEET_REAL_SGLANG_URL names a server this test cannot kill and restart")
    settings = isolated_settings(redis_url, str(tmp_path / "out"), lease_s=60)
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(60, seed=9, length=48)
    workers = [_worker(f"real-k{i}", settings, real_sglang, tmp_path, inflight=4) for i in range(2)]
    try:
        for w in workers:
            w.start().wait_ready(client, settings.keys, timeout_s=120)
        job = submit(settings, "faults", prompts, **GREEDY)
        done = lambda: job_progress(client, settings.keys, "faults")["done"]  # noqa: E731
        # When the server is SIGKILLed a quarter of the way through, and comes back a minute later…
        wait_until(lambda: done() >= 15, 600, 0.5, what="15 rows")
        real_sglang.kill()
        real_sglang.start(wait=True)
        restart = real_sglang.starts[-1]
        # …and a worker is SIGKILLed halfway (its claims wait out their lease; the other worker takes them).
        wait_until(lambda: done() >= 30, 600, 0.5, what="30 rows")
        workers[0].kill()
        workers[0].start()
        wait_until(lambda: job_settled(client, settings, "faults", len(prompts)), 900, 1, what="the job settled")
        assert all(w.alive() for w in workers)
    finally:
        for w in workers:
            w.terminate()
    # Then nothing was lost, duplicated or altered, and the restart looked as the real server does: refused while
    # the weights load, then 200 (503 while warming up where the poll caught it).
    _check_stored_as_served(settings, "faults", job.prompts, real_sglang)
    codes = [code for _t, code in restart]
    assert codes[0] == 0 and codes[-1] == 200 and set(codes) <= {0, 503, 200}, restart


def test_producer_cancel_aborts_the_requests_in_flight(real_sglang: RealServer, redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(6, seed=11, length=32)
    worker = _worker("real-c", settings, real_sglang, tmp_path).start()
    tokens_before = real_sglang.metric("sglang:generation_tokens_total")
    try:
        worker.wait_ready(client, settings.keys, timeout_s=120)
        # Long generations (ignore_eos: a random model may emit a stop id early), so they are in flight when
        # the job is cancelled.
        submit(settings, "cancel", prompts, max_new_tokens=3000, temperature=0.0, ignore_eos=True)
        wait_until(lambda: real_sglang.metric("sglang:num_running_reqs") >= len(prompts), 120, 0.2, what="in flight")
        out = producer_cli(settings, "cancel", "cancel")
        assert out.returncode == 0, out.stderr
        wait_until(lambda: job_settled_dead(client, settings, "cancel", len(prompts)), 120, 0.5, what="dead-lettered")
        # Then the server stopped generating them (aborted, not run to 3,000 tokens) and nothing was stored.
        wait_until(lambda: real_sglang.metric("sglang:num_running_reqs") == 0, 60, 0.2, what="the server idle")
    finally:
        worker.terminate()
    # (run to the end, they would have generated 3,000 tokens each)
    assert real_sglang.metric("sglang:generation_tokens_total") - tokens_before < len(prompts) * 3000
    assert {d["error_class"] for d in dead_letters(client, settings.keys, "cancel").values()} == {"cancelled"}
    assert read_committed(settings.output_uri, "cancel", columns=["prompt_id"]).num_rows == 0


def job_settled_dead(client: redis.Redis, settings: Any, job: str, n: int) -> bool:
    return job_progress(client, settings.keys, job)["dead"] == n


def test_prompts_the_server_must_not_see_are_refused_before_it(
    real_sglang: RealServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a prompt longer than the model's context, one with an id >= the vocabulary, and a normal one.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    context = _context_length(real_sglang)
    rng = np.random.default_rng(1)
    prompts = {
        "long": rng.integers(100, 150_000, size=context + 10).tolist(),
        "oov": [*make_prompts(1, seed=2)["p00000"][:-1], VOCAB + 5, kimi.THINK_START],
        "fine": make_prompts(1, seed=4)["p00000"],
    }
    generates = lambda: real_sglang.metric("sglang:http_responses_total", endpoint="/generate")  # noqa: E731
    requests_before = generates()
    worker = _worker("real-r", settings, real_sglang, tmp_path).start()
    try:
        worker.wait_ready(client, settings.keys, timeout_s=120)
        submit(settings, "refuse", prompts, **GREEDY)
        wait_until(
            lambda: sum(job_progress(client, settings.keys, "refuse")[k] for k in ("done", "dead")) == 3, 300, 0.5
        )
    finally:
        worker.terminate()
    dead = dead_letters(client, settings.keys, "refuse")
    assert {k: v["error_class"] for k, v in dead.items()} == {"long": "context_overflow", "oov": "invalid_ids"}
    # Only the normal prompt reached the server.
    assert generates() - requests_before == 1


def _context_length(server: RealServer) -> int:
    status, body = get(server.url + "/v1/models")
    assert status == 200
    return int(json.loads(body)["data"][0]["max_model_len"])


# -- the protocol, measured: the simulator's profile of the release against the real server -------------------
#: Keys a real server adds or leaves out by its own timing: ``decode_throughput`` appears only when a token
#: reached the tokenizer manager before the last one.
TIMING_DEPENDENT = frozenset({"decode_throughput"})


def shape(value: Any) -> Any:
    """The skeleton of a JSON value: keys and types, not values (lists by their first element)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in TIMING_DEPENDENT}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__


def differences(real: Any, sim: Any, path: str = "") -> list[str]:
    """Every path where two skeletons differ: ``path: real X, sim Y`` (a key on one side only is one line)."""
    if isinstance(real, dict) and isinstance(sim, dict):
        out = []
        for key in sorted(set(real) | set(sim)):
            where = f"{path}.{key}" if path else key
            if key not in sim:
                out.append(f"{where}: only the real server")
            elif key not in real:
                out.append(f"{where}: only the simulator")
            else:
                out += differences(real[key], sim[key], where)
        return out
    if isinstance(real, list) and isinstance(sim, list):
        if real and sim:
            return differences(real[0], sim[0], path + "[]")
        return [] if bool(real) == bool(sim) else [f"{path}: real {real!r}, sim {sim!r}"]
    return [] if real == sim else [f"{path}: real {real}, sim {sim}"]


DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang-versions.md"
DOC_SECTION = f"## Measured: the simulator's {VERSION} profile against a real {VERSION}"


def documented_differences() -> set[str]:
    """The differences docs/sglang-versions.md lists (and explains) in :data:`DOC_SECTION`: each bullet's
    first backticked text."""
    text = DOC.read_text()
    assert DOC_SECTION in text, f"{DOC} has no section {DOC_SECTION!r}"
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}


def _sse(raw: str) -> list[Any]:
    chunks = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    return [c if c == "[DONE]" else json.loads(c) for c in chunks]


def probe(url: str, prompt: list[int], context: int) -> dict[str, tuple[int, Any]]:
    """Each endpoint, normal and error cases: name → (status, skeleton of the body). Not sent: what kills a real
    0.5.9 (an id >= the vocabulary, a rid repeated in a batch: docs/sglang-versions.md), which the worker never
    sends (0.5.23 refuses the repeated rid; the out-of-vocabulary id is not sent to it either)."""
    import urllib.request

    results: dict[str, tuple[int, Any]] = {}
    too_long = (prompt * (context // len(prompt) + 2))[: context + 10]
    for name, path in (
        ("health", "/health"),
        ("health_generate", "/health_generate"),
        ("model_info", "/get_model_info"),
        ("server_info", "/get_server_info"),
        ("v1_models", "/v1/models"),
    ):
        status, body = get(url + path, timeout_s=60)
        results[name] = (status, shape(json.loads(body)) if body else body.decode())
    posts: dict[str, dict[str, Any]] = {
        "generate": {"input_ids": prompt, "sampling_params": GREEDY},
        "generate_batch": {"input_ids": [prompt, prompt[:-3]], "sampling_params": GREEDY},
        "generate_logprobs": {
            "input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": -1, "return_text_in_logprobs": False,
        },
        "generate_unknown_sampling_key": {"input_ids": prompt, "sampling_params": {**GREEDY, "bogus": 1}},
        "generate_context_overflow": {"input_ids": too_long, "sampling_params": GREEDY},
        "generate_input_plus_new_at_context": {
            "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": context - len(prompt)},
        },
        "generate_empty_input": {"input_ids": [], "sampling_params": GREEDY},
        "abort_unknown_rid": {"rid": "no-such-request"},
    }  # fmt: skip
    # The prompt once, unmeasured: a real server that served the tier's jobs has their common prefix cached, a
    # fresh simulator nothing, and 0.5.23's cached_tokens_details is null or a dict by that alone.
    post(url + "/generate", posts["generate"], timeout_s=300)
    for name, payload in posts.items():
        path = "/abort_request" if name.startswith("abort") else "/generate"
        status, body = post(url + path, payload, timeout_s=300)
        results[name] = (status, shape(body) if not isinstance(body, str) else body)
    # A stream: cumulative chunks then [DONE].
    req = urllib.request.Request(
        url + "/generate", json.dumps({"input_ids": prompt, "sampling_params": GREEDY, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        chunks = _sse(r.read().decode())
    # (the real server copies its last send time into some intermediate chunks, not others)
    chunks[0]["meta_info"].pop("response_sent_to_client_ts", None)
    results["generate_stream"] = (r.status, {"first": shape(chunks[0]), "last": shape(chunks[-2]), "end": chunks[-1]})
    # An abort of a request in flight: its /generate answers with the abort finish_reason.
    answer: dict[str, Any] = {}

    def long_request() -> None:
        payload = {
            "input_ids": prompt,
            "rid": "to-abort",
            "sampling_params": {**GREEDY, "max_new_tokens": 2000, "ignore_eos": True},
        }
        answer["r"] = post(url + "/generate", payload, timeout_s=300)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.5)
    abort_status, _ = post(url + "/abort_request", {"rid": "to-abort"})
    thread.join(300)
    status, body = answer["r"]
    results["generate_aborted"] = (status, shape(body))
    results["abort_in_flight"] = (abort_status, None)
    return results


def test_the_simulators_profile_answers_as_the_real_server_does(real_sglang: RealServer, tmp_path: Path) -> None:
    from sglang_sim.testing import SimulatorProcess

    _, server_info = get(real_sglang.url + "/get_server_info")
    assert json.loads(server_info)["version"] == VERSION, "THINKFLEET_REAL_SGLANG_VERSION names another release"
    context = _context_length(real_sglang)
    _, info = get(real_sglang.url + "/get_model_info")
    model_path = json.loads(info)["model_path"]
    sim = SimulatorProcess(
        "--sglang-version", VERSION, "--model-path", model_path, "--model-family", "kimi",
        "--context-length", str(context), "--no-report-context-length", "--vocab-size", str(VOCAB),
        "--time-scale", "2", "--health-min-s", "0.2", "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2",
        "--max-running-requests", "256", "--max-queued-requests", "512",
    ).start()  # fmt: skip
    try:
        prompt = make_prompts(1, seed=21, length=40)["p00000"]
        real = probe(real_sglang.url, prompt, context)
        simulated = probe(sim.url, prompt, context)
    finally:
        sim.stop()
    found: set[str] = set()
    for name in real:
        (real_status, real_body), (sim_status, sim_body) = real[name], simulated[name]
        if real_status != sim_status:
            found.add(f"{name}: status real {real_status}, sim {sim_status}")
        for line in differences(real_body, sim_body):
            # /server_info is every server argument (~330 keys): only what the simulator answers is compared.
            if name == "server_info" and line.endswith("only the real server"):
                continue
            found.add(f"{name}: {line}")
    documented = documented_differences()
    unexplained = sorted(found - documented)
    stale = sorted(documented - found)
    assert not unexplained, (
        "differences neither fixed in the simulator nor listed in docs/sglang-versions.md:\n" + "\n".join(unexplained)
    )
    assert not stale, "docs/sglang-versions.md lists differences that no longer occur:\n" + "\n".join(stale)
