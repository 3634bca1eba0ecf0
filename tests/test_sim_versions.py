"""The simulator imitates a given SGLang release (``--sglang-version``), its start-up and health, and its
NaN/abort finishes — as read from the 0.5.9 and 0.5.23 wheels (docs/sglang-versions.md)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_sim.config import SimConfig
from sglang_sim.content import NAN_MATCHED, expected_generation, nan_overwrite_id
from sglang_sim.sampling import CONTRACT_SAMPLING_FIELDS
from sglang_sim.testing import SimulatorProcess, SimulatorThread, wait_for_port
from sglang_sim.versions import PROFILES
from thinkfleet import kimi
from thinkfleet.sglang_version import SGLANG_IMAGE, SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [kimi.IM_USER, 13, 14, kimi.IM_MIDDLE, 15, kimi.IM_END, kimi.IM_ASSISTANT, 16, kimi.IM_MIDDLE, 163606]
OLD, NEW = "0.5.9", "0.5.23"
FAST = {"health_min_s": 0.05}
#: meta_info keys of a finished non-streamed generation, in SGLang's order.
#: As measured against a real 0.5.9 with --enable-metrics (tests/real_sglang): the scheduler's timing keys.
TIMING = ["queue_time", "prefill_launch_delay", "prefill_launch_latency", "prefill_finished_ts"]
FINISH_TIMING = ["request_received_ts", "request_sent_to_scheduler_ts", "decode_finished_ts", "inference_time"]
#: …and against a real 0.5.23 (flat keys of observability/req_time_stats.py).
TIMING_NEW = ["storage_prefetch_wait", "storage_staging_wait", "forward_entry_time", "prefill_finished_time"]
TIMING_NEW += ["queue_time"]
FINISH_TIMING_NEW = ["request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts"]
FINISH_TIMING_NEW += ["request_finished_ts"]
META_KEYS = {
    OLD: ["id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions", *TIMING],
    NEW: ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", *TIMING_NEW, "reasoning_tokens"],
}
TAIL_KEYS = {
    OLD: ["completion_tokens", "cached_tokens", "cached_tokens_details", "e2e_latency", *FINISH_TIMING],
    NEW: [
        "completion_tokens", "cached_tokens", "weight_versions", "cached_tokens_details", "dp_rank", "e2e_latency",
        *FINISH_TIMING_NEW,
    ],
}  # fmt: skip


def generate(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=timeout_s)


def stats(url: str) -> dict[str, Any]:
    return requests.get(f"{url}/control/stats", timeout=10).json()


def timed(fn: Callable[[], requests.Response]) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    resp = fn()
    return resp, time.monotonic() - t0


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def sse_chunks(resp: requests.Response) -> list[Any]:
    events = [e[len(b"data: ") :] for e in resp.content.split(b"\n\n")[:-1]]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimulatorThread]]:
    """One fast simulator per release (context 4096, so the boundary is cheap to reach)."""
    with (
        SimulatorThread(time_scale=2000, context_length=4096, sglang_version=OLD, **FAST) as old,
        SimulatorThread(time_scale=2000, context_length=4096, sglang_version=NEW, **FAST) as new,
    ):
        yield {OLD: old, NEW: new}


# -- the pinned version ----------------------------------------------------------------------------------
def test_the_deployed_release_is_pinned_once_and_is_the_simulators_default() -> None:
    assert SGLANG_IMAGE.removeprefix("lmsysorg/sglang:v") == SGLANG_VERSION
    assert SimConfig().server.sglang_version == SGLANG_VERSION
    assert SGLANG_VERSION in PROFILES and set(PROFILES) == {OLD, NEW}


def test_every_compose_file_runs_the_pinned_sglang_image() -> None:
    files = [*ROOT.glob("docker-compose*.y*ml"), *(ROOT / "deploy").rglob("*compose*.y*ml"), ROOT / ".env.example"]
    tags = {
        (path.relative_to(ROOT).as_posix(), tag)
        for path in files
        if path.is_file()
        for tag in re.findall(r"lmsysorg/sglang:v(\d+\.\d+\.\d+(?:\.post\d+)?)", path.read_text())
    }
    assert ("docker-compose.yml", SGLANG_VERSION) in tags  # the node's compose file pins it
    assert {tag for _, tag in tags} == {SGLANG_VERSION}, tags


# -- meta_info, errors, boundaries -----------------------------------------------------------------------
@pytest.mark.parametrize("version", [OLD, NEW])
def test_meta_info_keys_per_release(sims: dict[str, SimulatorThread], version: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3000}, "require_reasoning": True}
    out = generate(sims[version].url, body).json()

    meta = out["meta_info"]
    assert list(meta) == META_KEYS[version] + TAIL_KEYS[version] + ["response_sent_to_client_ts"]
    retractions = "total_retractions" if version == OLD else "num_retractions"
    assert meta[retractions] == 0
    if version == NEW:
        assert meta["reasoning_tokens"] == out["output_ids"].index(kimi.THINK_END) + 1
    assert out["output_ids"] == expected_generation(PROMPT, {"max_new_tokens": 3000}).output_ids


def test_unknown_sampling_key_is_a_500_before_the_contract_and_a_400_string_after(
    sims: dict[str, SimulatorThread],
) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}}
    old = generate(sims[OLD].url, body)
    new = generate(sims[NEW].url, body)
    new_stream = generate(sims[NEW].url, {**body, "stream": True})

    # 0.5.9: SamplingParams(**kw) raises TypeError, which FastAPI turns into its plain-text 500.
    assert (old.status_code, old.text) == (500, "Internal Server Error")
    assert old.headers["Content-Type"].startswith("text/plain")
    # 0.5.22+: the api/v1 contract refuses it before anything runs, streamed or not: {"error": <str>}.
    fields = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
    expected = {"error": f"unknown field `temprature`, expected one of {fields}"}
    for resp in (new, new_stream):
        assert (resp.status_code, resp.json()) == (400, expected)
    assert CONTRACT_SAMPLING_FIELDS[0] == "max_new_tokens" and "sampling_seed" in CONTRACT_SAMPLING_FIELDS


def test_mistyped_sampling_value_per_release(sims: dict[str, SimulatorThread]) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}
    old = generate(sims[OLD].url, body)
    new = generate(sims[NEW].url, body)

    assert (old.status_code, old.text) == (500, "Internal Server Error")  # '<' between str and float
    assert (new.status_code, new.json()) == (400, {"error": 'invalid type: string "hot", expected f64'})


def test_unknown_sampling_key_in_a_0_5_9_stream_closes_the_started_response(sims: dict[str, SimulatorThread]) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"bogus": 1}, "stream": True}
    with pytest.raises((requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError)):
        resp = generate(sims[OLD].url, body)
        resp.raise_for_status()
        sse_chunks(resp)


@pytest.mark.parametrize("version", [OLD, NEW])
def test_context_boundary_at_exactly_the_limit(sims: dict[str, SimulatorThread], version: str) -> None:
    prompt = list(range(1, 97))
    at_limit = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4096 - len(prompt)}}
    over = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4097 - len(prompt)}}
    exact = generate(sims[version].url, at_limit)
    beyond = generate(sims[version].url, over)

    message = (
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a "
        "total of {} tokens: 96 tokens from the input messages and {} tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    assert (beyond.status_code, beyond.json()) == (400, {"error": {"message": message.format(4097, 4001)}})
    if version == OLD:  # input + max_new_tokens >= context is refused up to 0.5.10
        assert (exact.status_code, exact.json()) == (400, {"error": {"message": message.format(4096, 4000)}})
    else:  # only > from 0.5.11
        assert exact.status_code == 200
        assert exact.json()["output_ids"] == expected_generation(prompt, at_limit["sampling_params"]).output_ids


def test_a_prompt_of_context_length_is_refused_by_both(sims: dict[str, SimulatorThread]) -> None:
    for version in (OLD, NEW):
        resp = generate(sims[version].url, {"input_ids": [1] * 4096})
        message = "The input (4096 tokens) is longer than the model's context length (4096 tokens)."
        assert (resp.status_code, resp.json()) == (400, {"error": {"message": message}})


def test_streamed_validation_error_chunk_per_release(sims: dict[str, SimulatorThread]) -> None:
    old = sse_chunks(generate(sims[OLD].url, {"input_ids": [], "stream": True}))
    new = sse_chunks(generate(sims[NEW].url, {"input_ids": [], "stream": True}))

    assert old == [{"error": {"message": "input_ids cannot be empty."}}]
    assert new == [
        {
            "error": {
                "message": "input_ids cannot be empty.",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }
    ]


# -- duplicate rids --------------------------------------------------------------------------------------
LONG = {"max_new_tokens": 100_000, "ignore_eos": True}


def test_duplicate_in_flight_rid_is_refused_from_0_5_11() -> None:
    with SimulatorThread(time_scale=2, sglang_version=NEW, **FAST) as sim:
        first, box = in_background(
            lambda: generate(sim.url, {"input_ids": PROMPT, "rid": "dup", "sampling_params": LONG})
        )
        eventually(lambda: "dup" in sim.call(lambda s: set(s.inflight)))
        again = generate(sim.url, {"input_ids": [1, 2], "rid": "dup"})
        in_batch = generate(sim.url, {"input_ids": [[1], [2]], "rid": ["a", "a"]})
        requests.post(f"{sim.url}/abort_request", json={"rid": "dup"}, timeout=10)
        first.join(10)

    assert (again.status_code, again.json()) == (400, {"error": {"message": "Duplicate request ID detected: dup"}})
    message = "Duplicate request IDs detected within the request: ['a']"
    assert (in_batch.status_code, in_batch.json()) == (400, {"error": {"message": message}})
    assert box["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_duplicate_in_flight_rid_is_accepted_by_0_5_9_and_the_first_caller_is_never_answered() -> None:
    with SimulatorThread(time_scale=2, sglang_version=OLD, **FAST) as sim:
        first, box = in_background(
            lambda: generate(sim.url, {"input_ids": PROMPT, "rid": "dup", "sampling_params": LONG}, timeout_s=3)
        )
        eventually(lambda: "dup" in sim.call(lambda s: set(s.inflight)))
        again = generate(sim.url, {"input_ids": [1, 2], "rid": "dup", "sampling_params": {"max_new_tokens": 3}})
        with pytest.raises(requests.exceptions.ReadTimeout):  # rid_to_state[rid] was replaced
            generate(sim.url, {"input_ids": [[1], [2]], "rid": ["b", "b"]}, timeout_s=1.5)
        first.join(10)
        counts = stats(sim.url)

    assert again.status_code == 200 and again.json()["meta_info"]["id"] == "dup"
    assert again.json()["output_ids"] == expected_generation([1, 2], {"max_new_tokens": 3}).output_ids
    assert isinstance(box.get("error"), requests.exceptions.ReadTimeout)
    assert counts["duplicate_rids"] == ["dup", "b"]


# -- start-up and health ---------------------------------------------------------------------------------
def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True


def test_port_refuses_connections_while_the_weights_load() -> None:
    proc = SimulatorProcess("--load-s", "2", "--sglang-version", NEW, "--health-min-s", "0.05")
    t0 = time.monotonic()
    proc.start(wait=False)
    try:
        assert refused(proc.port)
        deadline = time.monotonic() + 60
        while "loading weights" not in proc.log():  # until the interpreter is up; the "model" is still loading
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
        assert refused(proc.port)
        wait_for_port(proc.port, timeout_s=20)
        assert time.monotonic() - t0 >= 2.0
        assert requests.get(f"{proc.url}/health", timeout=10).status_code == 200
        assert requests.get(f"{proc.url}/server_info", timeout=10).json()["version"] == NEW
    finally:
        proc.stop()
    assert "loading weights for 2.0 s" in proc.log()


def test_warm_up_answers_503_on_health_and_serves_generate() -> None:
    with (
        SimulatorThread(time_scale=1000, warmup_s=1.5, sglang_version=NEW, **FAST) as sim,
        SimulatorThread(time_scale=1000, warmup_s=1.5, warmup_rejects_generate=True, **FAST) as strict,
    ):
        for path in ("/health", "/health_generate", "/ready"):
            resp, took = timed(lambda path=path: requests.get(f"{sim.url}{path}", timeout=10))
            assert (resp.status_code, resp.content) == (503, b"") and took < 0.5  # ServerStatus.Starting
        served = generate(sim.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        rejected = generate(strict.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        assert served.status_code == 200  # the real server does not gate /generate on warm-up
        assert rejected.status_code == 503 and rejected.json()["code"] == 503
        eventually(lambda: requests.get(f"{sim.url}/health", timeout=10).status_code == 200)
        assert requests.get(f"{sim.url}/ready", timeout=10).status_code == 200
        assert requests.get(f"{strict.url}/ready", timeout=10).status_code == 404  # no /ready in 0.5.9


def test_health_takes_at_least_the_scheduler_round_trip() -> None:
    assert SimConfig().server.health_min_s == 1.0
    with SimulatorThread(time_scale=1000) as default, SimulatorThread(time_scale=1000, health_min_s=0.3) as sim:
        resp, took = timed(lambda: requests.get(f"{default.url}/health_generate", timeout=10))
        assert (resp.status_code, resp.content) == (200, b"") and took >= 1.0
        for path in ("/health", "/health_generate"):
            resp, took = timed(lambda path=path: requests.get(f"{sim.url}{path}", timeout=10))
            assert (resp.status_code, resp.content) == (200, b"") and 0.3 <= took < 0.9
        delay = requests.post(f"{sim.url}/control/health_delay", json={"seconds": 0.5}, timeout=10)
        assert delay.json() == {"health_delay_s": 0.5}
        resp, took = timed(lambda: requests.get(f"{sim.url}/health", timeout=10))
        assert resp.status_code == 200 and took >= 0.8
        assert requests.post(f"{sim.url}/control/health_delay", json={"seconds": -1}, timeout=10).status_code == 400


def test_health_slower_than_the_check_timeout_is_a_503_and_the_server_not_ready() -> None:
    with SimulatorThread(time_scale=1000, sglang_version=NEW, health_min_s=0.1, health_check_timeout_s=0.6) as sim:
        requests.post(f"{sim.url}/control/health_delay", json={"seconds": 5}, timeout=10)
        resp, took = timed(lambda: requests.get(f"{sim.url}/health_generate", timeout=10))
        assert resp.status_code == 503 and 0.6 <= took < 2.0
        assert requests.get(f"{sim.url}/ready", timeout=10).status_code == 503  # ServerStatus.UnHealthy
        requests.post(f"{sim.url}/control/health_delay", json={"seconds": 0}, timeout=10)
        assert requests.get(f"{sim.url}/health_generate", timeout=10).status_code == 200
        assert requests.get(f"{sim.url}/ready", timeout=10).status_code == 200


def test_stall_answers_nothing_freezes_generation_then_resumes() -> None:
    # 200 tokens at 40 tok/s × time_scale 10 ≈ 0.5 wall s of decoding.
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "rid": "slow"}
    with SimulatorThread(time_scale=10, **FAST) as sim:
        thread, box = in_background(lambda: timed(lambda: generate(sim.url, body)))
        eventually(lambda: stats(sim.url)["running"] == 1)
        stalled = requests.post(f"{sim.url}/control/stall", json={"seconds": 1.5}, timeout=10).json()
        assert stalled == {"stalled": True, "seconds": 1.5}
        frozen_at = stats(sim.url)["sim_time_s"]
        with pytest.raises(requests.exceptions.ReadTimeout):  # nothing answers: not health, not /generate
            requests.get(f"{sim.url}/health", timeout=0.4)
        late, late_box = in_background(lambda: timed(lambda: requests.get(f"{sim.url}/model_info", timeout=10)))
        time.sleep(0.3)
        during = stats(sim.url)  # /control/* still answers
        assert during["stalled"] is True and during["sim_time_s"] == frozen_at and during["running"] == 1
        thread.join(10)
        late.join(10)
        after = stats(sim.url)

    resp, took = box["result"]
    assert resp.status_code == 200 and took >= 1.5 + 0.3
    assert resp.json()["output_ids"] == expected_generation(PROMPT, body["sampling_params"]).output_ids
    late_resp, late_took = late_box["result"]
    assert late_resp.status_code == 200 and late_took >= 0.9  # received during the stall, answered after it
    assert after["stalled"] is False and after["stalls"] == 1 and after["paused_wall_s"] >= 1.4


def test_stall_zero_ends_a_stall_at_once() -> None:
    with SimulatorThread(time_scale=1000, **FAST) as sim:
        requests.post(f"{sim.url}/control/stall", json={"seconds": 60}, timeout=10)
        thread, box = in_background(lambda: requests.get(f"{sim.url}/health", timeout=10))
        time.sleep(0.2)
        assert requests.post(f"{sim.url}/control/stall", json={"seconds": 0}, timeout=10).json()["stalled"] is False
        thread.join(10)
    assert box["result"].status_code == 200


# -- NaN and abort finishes ------------------------------------------------------------------------------
def test_nan_generations_overwrite_the_last_id_and_are_listed() -> None:
    params = {"max_new_tokens": 3000, "stop_token_ids": [kimi.IM_END]}
    with SimulatorThread(time_scale=2000, nan_rate=0.5, fault_seed=3, **FAST) as sim:
        outs = {
            f"n{i}": generate(sim.url, {"input_ids": [*PROMPT, i], "rid": f"n{i}", "sampling_params": params})
            for i in range(24)
        }
        counts = stats(sim.url)

    nan_rids = set(counts["nan_rids"])
    assert 4 <= len(nan_rids) <= 20 and len(counts["nan_rids"]) == len(nan_rids)
    for i, (rid, resp) in enumerate(outs.items()):
        assert resp.status_code == 200
        out = resp.json()
        expected = expected_generation([*PROMPT, i], params)
        meta = out["meta_info"]
        assert meta["completion_tokens"] == len(out["output_ids"])
        if rid not in nan_rids:  # every other generation is the content model's, byte for byte
            assert out["output_ids"] == expected.output_ids and meta["finish_reason"] == expected.finish_reason
            continue
        assert meta["finish_reason"] == {"type": "stop", "matched": NAN_MATCHED}
        ids = out["output_ids"]
        assert len(ids) < len(expected.output_ids)  # stopped early
        assert ids[:-1] == expected.output_ids[: len(ids) - 1]
        # The model's EOS set wins over the request's stop ids: [EOS] 163585 for Kimi's {163586, 163585}.
        assert ids[-1] == kimi.EOS == nan_overwrite_id([kimi.IM_END], kimi.DEFAULT_STOP_TOKEN_IDS, kimi.VOCAB_SIZE)


def test_nan_overwrite_id_follows_sglangs_order() -> None:
    assert nan_overwrite_id([], [kimi.IM_END], 100) == kimi.IM_END
    assert nan_overwrite_id([7], [], 100) == 7  # no model EOS: the request's first stop id (set order)
    assert nan_overwrite_id([], [], 100) == 100  # neither: the out-of-vocabulary sample stays


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (
            503,
            {
                "object": "error",
                "message": "Request running timeout reached.",
                "type": "503",
                "param": None,
                "code": 503,
            },
        ),
        (
            500,
            {
                "object": "error",
                "message": "Grammar accept_token failed: sglang-sim injected abort",
                "type": "500",
                "param": None,
                "code": 500,
            },
        ),
        (400, {"error": {"message": "Invalid request: sglang-sim injected abort"}}),
    ],
)
def test_aborted_generation_answers_the_http_status_sglang_raises(status: int, body: dict[str, Any]) -> None:
    params = {"max_new_tokens": 400, "ignore_eos": True}
    with SimulatorThread(time_scale=2000, abort_rate=1.0, abort_status_code=status, **FAST) as sim:
        plain = generate(sim.url, {"input_ids": PROMPT, "rid": "a1", "sampling_params": params})
        streamed = generate(sim.url, {"input_ids": PROMPT, "rid": "a2", "sampling_params": params, "stream": True})
        counts = stats(sim.url)

    assert (plain.status_code, plain.json()) == (status, body)
    assert streamed.status_code == 200
    final = sse_chunks(streamed)[-1]
    err_type = {503: None, 500: "InternalServerError", 400: "BadRequestError"}[status]
    message = body["error"]["message"] if status == 400 else body["message"]
    assert final["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": message,
        "status_code": status,
        "err_type": err_type,
    }
    ids = final["output_ids"]
    assert len(ids) < 400 and ids == expected_generation(PROMPT, params).output_ids[: len(ids)]
    assert counts["abort_rids"] == ["a1", "a2"] and counts["aborted"] == 2


def test_generation_fault_rates_change_at_runtime() -> None:
    with SimulatorThread(time_scale=2000, **FAST) as sim:
        changed = requests.post(
            f"{sim.url}/control/faults", json={"abort_rate": 1.0, "abort_status_code": 400}, timeout=10
        )
        assert changed.json()["abort_rate"] == 1.0
        assert generate(sim.url, {"input_ids": PROMPT}).status_code == 400
        bad = requests.post(f"{sim.url}/control/faults", json={"abort_status_code": 418}, timeout=10)
        assert bad.status_code == 400


# -- /server_info and /model_info ------------------------------------------------------------------------
MODEL_INFO_KEYS = {
    OLD: [
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
    ],
    NEW: [
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "load_format",
        "reasoning_parser",
        "tool_call_parser",
        "disaggregation_mode",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
        "embedding",
    ],
}


@pytest.mark.parametrize("version", [OLD, NEW])
def test_info_endpoints_per_release(sims: dict[str, SimulatorThread], version: str) -> None:
    url = sims[version].url
    model = requests.get(f"{url}/model_info", timeout=10).json()
    server = requests.get(f"{url}/server_info", timeout=10).json()
    models = requests.get(f"{url}/v1/models", timeout=10).json()

    assert list(model) == MODEL_INFO_KEYS[version]
    assert server["version"] == version
    assert server["enable_deterministic_inference"] is False and server["sampling_backend"] == "flashinfer"
    assert server["context_length"] == 4096  # the CLI value (null when a real server is not given one)
    assert server["max_req_input_len"] == 4096 - 6  # min(context_len - 1, pool - 1) - 5
    assert models["data"][0]["max_model_len"] == 4096  # the effective context length, every release
    state = server["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 256
    assert state["enable_deterministic_inference"] is False
    # No release reports the vocabulary size: a client reads it from the model's config.
    assert not any("vocab" in key for key in (*model, *server, *state))
    extended = {"launch_command", "startup_time", "hicache_object_layout", "kv_events", "frontend"}
    if version == OLD:
        assert not extended & set(server)
        assert isinstance(state["memory_usage"]["graph"], float)
    else:
        assert extended <= set(server) and server["frontend"] == "python"
        assert isinstance(state["memory_usage"]["graph"], dict)


def test_deterministic_inference_is_reported_as_the_real_server_reports_it() -> None:
    args = {"time_scale": 2000, "enable_deterministic_inference": True, "report_context_length": False, **FAST}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500, "sampling_seed": 5}}
    with SimulatorThread(**args) as sim:
        server = requests.get(f"{sim.url}/server_info", timeout=10).json()
        first, second = generate(sim.url, body).json(), generate(sim.url, body).json()

    assert server["enable_deterministic_inference"] is True
    assert server["internal_states"][0]["enable_deterministic_inference"] is True
    # What the flag forces on a Hopper node with tp 8.
    assert (server["sampling_backend"], server["attention_backend"], server["disable_custom_all_reduce"]) == (
        "pytorch",
        "fa3",
        True,
    )
    assert server["context_length"] is None
    assert (
        first["output_ids"] == second["output_ids"] == expected_generation(PROMPT, body["sampling_params"]).output_ids
    )


def test_cli_rejects_an_unknown_release() -> None:
    from sglang_sim.cli import config_from_args

    assert config_from_args(["--sglang-version", NEW]).server.sglang_version == NEW
    assert config_from_args(["--slow-start-s", "2"]).server.warmup_s == 2.0  # the old flag name
    with pytest.raises(SystemExit):
        config_from_args(["--sglang-version", "0.5.15"])
