"""The simulator speaks SGLang's native protocol (``/generate``, ``/health``, ``/get_server_info``…), over real HTTP.

These tests run the newest imitated release (0.5.23: ``num_retractions``, ``reasoning_tokens``, duplicate
rids refused); what the deployed 0.5.9 does differently is in test_sim_versions.py.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_sim.content import ContentConfig, expected_generation
from sglang_sim.testing import SimulatorThread
from sglang_sim.text import placeholder_token
from thinkfleet import kimi

SYSTEM_TURN = [kimi.IM_SYSTEM, 10, 11, kimi.IM_MIDDLE, 12, kimi.IM_END]
USER_TURN = [kimi.IM_USER, 13, 14, kimi.IM_MIDDLE, 15, kimi.IM_END]
#: A Kimi-K2.5 thinking-mode prompt: it ends with <think>, so the output starts inside reasoning.
PROMPT = [*SYSTEM_TURN, *USER_TURN, kimi.IM_ASSISTANT, 16, kimi.IM_MIDDLE, kimi.THINK_START]
#: meta_info keys in SGLang's order (tokenizer_manager._handle_batch_output).
META_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"]
#: 0.5.23 with --enable-metrics (the simulator's default), as measured against a real one (tests/real_sglang).
META_KEYS += ["storage_prefetch_wait", "storage_staging_wait", "forward_entry_time", "prefill_finished_time"]
META_KEYS += ["queue_time", "reasoning_tokens"]
#: The release these tests run (and the health round trip shortened: they poll health).
NEW = {"sglang_version": "0.5.23", "health_min_s": 0.05}
META_KEYS += [
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "request_received_ts",
    "first_token_latency",
    "api_server_dispatch_finish_ts",
    "request_finished_ts",
    "response_sent_to_client_ts",
]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorThread]:
    with SimulatorThread(time_scale=2000, context_length=32_768, weight_version="w7", **NEW) as thread:
        yield thread


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[SimulatorThread]:
    """Slow enough (40 tok/s × 2) that requests stay in flight while a test pokes at them."""
    with SimulatorThread(time_scale=2, **NEW) as thread:
        yield thread


def generate(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=timeout_s)


def test_single_request_returns_text_output_ids_and_meta_info(sim: SimulatorThread) -> None:
    resp = generate(sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30_000}, "rid": "one"})

    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/json")
    out = resp.json()
    assert list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert list(meta) == META_KEYS
    assert meta["id"] == "one" and meta["weight_version"] == "w7" and meta["num_retractions"] == 0
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "stop", "matched": kimi.IM_END}
    assert out["output_ids"][-1] == kimi.IM_END  # the matched stop token is included
    assert meta["reasoning_tokens"] == 0  # only counted with require_reasoning, as in SGLang
    assert meta["e2e_latency"] > 0
    assert "<|im_end|>" not in out["text"] and "</think>" in out["text"]  # stop token trimmed from text


def test_output_is_byte_identical_to_expected_generation(sim: SimulatorThread) -> None:
    params = {"max_new_tokens": 30_000, "sampling_seed": 3, "temperature": 0.7, "top_p": 0.95}
    first = generate(sim.url, {"input_ids": PROMPT, "sampling_params": params})
    second = generate(sim.url, {"input_ids": PROMPT, "sampling_params": params})
    other = generate(sim.url, {"input_ids": PROMPT, "sampling_params": {**params, "sampling_seed": 4}})

    expected = expected_generation(PROMPT, params, ContentConfig())
    body = first.json()
    assert body["output_ids"] == expected.output_ids
    assert body["meta_info"]["finish_reason"] == expected.finish_reason
    assert json.dumps(second.json()["output_ids"]) == json.dumps(body["output_ids"])
    assert other.json()["output_ids"] != body["output_ids"]


def test_length_cap_returns_exactly_max_new_tokens_ids(sim: SimulatorThread) -> None:
    out = generate(sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 9}}).json()

    assert len(out["output_ids"]) == 9 == out["meta_info"]["completion_tokens"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    default = generate(sim.url, {"input_ids": PROMPT}).json()
    assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 128}  # SGLang's default


def test_stop_token_ids_end_the_output_with_the_matched_id(sim: SimulatorThread) -> None:
    natural = generate(sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30_000}}).json()
    target = natural["output_ids"][4]
    params = {"max_new_tokens": 30_000, "stop_token_ids": [target], "no_stop_trim": True}
    out = generate(sim.url, {"input_ids": PROMPT, "sampling_params": params}).json()

    assert out["output_ids"] == natural["output_ids"][: natural["output_ids"].index(target) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["text"].endswith(placeholder_token(target))  # no_stop_trim keeps it in the text too


def test_ignore_eos_runs_to_max_new_tokens(sim: SimulatorThread) -> None:
    out = generate(
        sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    ).json()

    assert len(out["output_ids"]) == 3000
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3000}


def test_batch_returns_results_in_input_order_with_expanded_rids(sim: SimulatorThread) -> None:
    prompts = [[*PROMPT[:-1], i, kimi.THINK_START] for i in range(5)]
    caps = [3000, 1, 2000, 2, 500]  # very different lengths finish in a different order
    body = {"input_ids": prompts, "sampling_params": [{"max_new_tokens": c} for c in caps], "rid": "job"}
    outs = generate(sim.url, body).json()

    assert [o["meta_info"]["id"] for o in outs] == [f"job_{i}" for i in range(5)]
    for out, prompt, cap in zip(outs, prompts, caps, strict=True):
        assert out["output_ids"] == expected_generation(prompt, {"max_new_tokens": cap}).output_ids
    listed = generate(sim.url, {"input_ids": prompts[:2], "rid": ["x", "y"]}).json()
    assert [o["meta_info"]["id"] for o in listed] == ["x", "y"]
    mismatch = generate(sim.url, {"input_ids": prompts[:2], "rid": ["x"]})
    assert mismatch.status_code == 400
    assert mismatch.json() == {
        "error": {"message": "The specified rids length mismatch with the batch_size for batch processing."}
    }


def sse_events(resp: requests.Response) -> list[bytes]:
    raw = resp.content
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events]


def test_stream_sends_cumulative_chunks_then_done(sim: SimulatorThread) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30_000}, "stream": True, "rid": "s"}
    resp = requests.post(f"{sim.url}/generate", json=body, timeout=30)

    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # (how many chunks depends on how often the simulator's clock ticks while the answer is decoded: at least one
    # before the final one; a box at load 20 gave 2 where a quiet one gives more)
    assert len(chunks) >= 2
    final = expected_generation(PROMPT, {"max_new_tokens": 30_000})
    assert chunks[-1]["output_ids"] == final.output_ids
    assert chunks[-1]["meta_info"]["finish_reason"] == final.finish_reason
    for earlier, later in itertools.pairwise(chunks):
        assert earlier["meta_info"]["finish_reason"] is None
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]  # cumulative
        assert later["text"].startswith(earlier["text"])
    assert all(c["meta_info"]["completion_tokens"] == len(c["output_ids"]) for c in chunks)


def test_batch_stream_chunks_carry_their_index(sim: SimulatorThread) -> None:
    body = {"input_ids": [PROMPT, PROMPT[:-1]], "sampling_params": {"max_new_tokens": 50}, "stream": True}
    chunks = [json.loads(e) for e in sse_events(requests.post(f"{sim.url}/generate", json=body, timeout=30))[:-1]]

    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    assert finals[1]["output_ids"] == expected_generation(PROMPT[:-1], {"max_new_tokens": 50}).output_ids


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"input_ids": [1] * 32_768},
            "The input (32768 tokens) is longer than the model's context length (32768 tokens).",
        ),
        (
            {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 32_700}},
            "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a "
            "total of 32800 tokens: 100 tokens from the input messages and 32700 tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion to fit within the "
            "limit.",
        ),
        (
            {"input_ids": [1, kimi.VOCAB_SIZE]},
            f"The input_ids [1, {kimi.VOCAB_SIZE}] contains values greater than the vocab size ({kimi.VOCAB_SIZE}).",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            "temperature must be a non-negative finite number, got -1.",
        ),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
        (
            {"input_ids": [1], "sampling_params": {"stop": "</s>"}},
            "stop='</s>' is unavailable when skip_tokenizer_init=True (requires tokenizer to decode tokens to "
            "text for matching).",
        ),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "Duplicate request IDs detected within the request: ['a']"),
    ],
)
def test_invalid_requests_get_sglangs_400_and_wording(sim: SimulatorThread, body: dict, message: str) -> None:
    resp = generate(sim.url, body)

    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": message}}


def test_text_prompt_without_tokenizer_is_a_clear_400(sim: SimulatorThread) -> None:
    resp = generate(sim.url, {"text": "Hello"})

    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message.startswith("Tokenizer is not initialized but input_text requires tokenization.")
    assert "--tokenizer" in message


def test_wrong_json_types_get_the_error_response_shape(sim: SimulatorThread) -> None:
    bad_type = generate(sim.url, {"input_ids": "1 2 3"})
    not_json = requests.post(f"{sim.url}/generate", data=b"{not json", timeout=10)

    for resp in (bad_type, not_json):
        assert resp.status_code == 400
        body = resp.json()
        assert set(body) == {"object", "message", "type", "param", "code"}
        assert (body["object"], body["type"], body["param"], body["code"]) == ("error", "Bad Request", None, 400)
    assert "input_ids" in bad_type.json()["message"]
    assert "JSON decode error" in not_json.json()["message"]


def test_streamed_validation_error_is_an_sse_error_chunk(sim: SimulatorThread) -> None:
    resp = requests.post(f"{sim.url}/generate", json={"input_ids": [], "stream": True}, timeout=10)

    assert resp.status_code == 200  # SGLang validates inside the already-started stream
    events = sse_events(resp)
    assert events[-1] == b"[DONE]"
    assert json.loads(events[0]) == {
        "error": {
            "message": "input_ids cannot be empty.",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


def test_return_prompt_token_ids_and_require_reasoning(sim: SimulatorThread) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 30_000},
        "return_prompt_token_ids": True,
        "require_reasoning": True,
    }
    out = generate(sim.url, body).json()

    assert out["prompt_token_ids"] == PROMPT
    assert out["meta_info"]["reasoning_tokens"] == out["output_ids"].index(kimi.THINK_END) + 1


def test_repeated_prompt_prefix_is_reported_as_cached_tokens(sim: SimulatorThread) -> None:
    system = list(range(1000, 1200))
    first = generate(sim.url, {"input_ids": [*system, 1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).json()
    second = generate(sim.url, {"input_ids": [*system, 4, 5], "sampling_params": {"max_new_tokens": 1}}).json()

    assert first["meta_info"]["cached_tokens"] == 0
    assert 190 <= second["meta_info"]["cached_tokens"] <= 200  # the shared 200-token prefix, block-rounded
    flushed = requests.post(f"{sim.url}/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    third = generate(sim.url, {"input_ids": [*system, 6], "sampling_params": {"max_new_tokens": 1}}).json()
    assert third["meta_info"]["cached_tokens"] == 0


def test_info_endpoints_have_sglangs_keys(sim: SimulatorThread) -> None:
    health = requests.get(f"{sim.url}/health", timeout=10)
    assert (health.status_code, health.content) == (200, b"")
    assert requests.get(f"{sim.url}/health_generate", timeout=10).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(f"{sim.url}{path}", timeout=10).json()
        assert set(info) == {
            "model_path",
            "served_model_name",
            "load_format",
            "reasoning_parser",
            "tool_call_parser",
            "disaggregation_mode",
            "tokenizer_path",
            "is_generation",
            "preferred_sampling_params",
            "weight_version",
            "has_image_understanding",
            "has_audio_understanding",
            "model_type",
            "architectures",
            "embedding",
        }
        assert info["weight_version"] == "w7"
    for path in ("/server_info", "/get_server_info"):
        server = requests.get(f"{sim.url}{path}", timeout=10).json()
        for key in (
            "model_path",
            "tp_size",
            "max_running_requests",
            "max_queued_requests",
            "context_length",
            "reasoning_parser",
            "tool_call_parser",
            "schedule_policy",
            "max_total_num_tokens",
            "max_req_input_len",
            "version",
        ):
            assert key in server
        assert (server["schedule_policy"], server["reasoning_parser"]) == ("fcfs", "kimi_k2")
        state = server["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == 256
        assert {"last_gen_throughput", "memory_usage"} <= set(state)
    models = requests.get(f"{sim.url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
    assert (card["object"], card["owned_by"], card["parent"], card["max_model_len"]) == (
        "model",
        "sglang",
        None,
        32_768,
    )


def test_metrics_expose_sglang_names(sim: SimulatorThread) -> None:
    generate(sim.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
    text = requests.get(f"{sim.url}/metrics", timeout=10).text

    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:e2e_request_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
    ):
        assert f"\n{name}{{" in text


def post_in_background(url: str, body: dict[str, Any], results: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        resp = generate(url, body, timeout_s=60)
        results[body["rid"]] = (resp.status_code, resp.json())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_running(sim: SimulatorThread, rids: set[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not rids <= sim.call(lambda s: set(s.inflight)):
        assert time.monotonic() < deadline, "requests never arrived"
        time.sleep(0.02)


def test_duplicate_in_flight_rid_is_rejected(slow_sim: SimulatorThread) -> None:
    results: dict[str, Any] = {}
    body = {"input_ids": PROMPT, "rid": "dup", "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
    thread = post_in_background(slow_sim.url, body, results)
    wait_running(slow_sim, {"dup"})

    again = generate(slow_sim.url, {"input_ids": [1, 2], "rid": "dup"})
    assert again.status_code == 400
    assert again.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
    requests.post(f"{slow_sim.url}/abort_request", json={"rid": "dup"}, timeout=10)
    thread.join(10)
    assert results["dup"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_request_matches_rid_prefixes_and_returns_partial_output(slow_sim: SimulatorThread) -> None:
    results: dict[str, Any] = {}
    params = {"max_new_tokens": 100_000, "ignore_eos": True}
    threads = [
        post_in_background(slow_sim.url, {"input_ids": [*PROMPT, i], "rid": rid, "sampling_params": params}, results)
        for i, rid in enumerate(["job1", "job10", "job2"])
    ]
    wait_running(slow_sim, {"job1", "job10", "job2"})
    time.sleep(0.3)  # let them decode a few tokens

    not_in_flight = requests.post(f"{slow_sim.url}/abort_request", json={"rid": "job"}, timeout=10)
    aborted = requests.post(f"{slow_sim.url}/abort_request", json={"rid": "job1"}, timeout=10)
    assert (not_in_flight.status_code, aborted.status_code, aborted.content) == (200, 200, b"")
    for thread in threads[:2]:
        thread.join(10)
    assert "job2" not in results  # "job" was not an in-flight rid, and "job1" does not prefix "job2"
    for rid in ("job1", "job10"):
        status, out = results[rid]
        assert status == 200
        assert out["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < len(out["output_ids"]) == out["meta_info"]["completion_tokens"] < 100_000
        assert (
            out["output_ids"]
            == expected_generation([*PROMPT, ["job1", "job10"].index(rid)], params).output_ids[: len(out["output_ids"])]
        )
    busy = requests.post(f"{slow_sim.url}/flush_cache", timeout=10)
    assert busy.status_code == 400  # job2 still runs
    requests.post(f"{slow_sim.url}/abort_request", json={"abort_all": True}, timeout=10)
    threads[2].join(10)
    assert results["job2"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_put_is_accepted_like_post(sim: SimulatorThread) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 7}}
    resp = requests.put(f"{sim.url}/generate", json=body, timeout=10)

    assert resp.status_code == 200
    assert resp.json()["output_ids"] == expected_generation(PROMPT, {"max_new_tokens": 7}).output_ids


def write_word_tokenizer(directory: Path, words: int) -> None:
    """A tiny HF tokenizer: words w0..w{n-1} plus Kimi's special tokens at their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)} | {"[UNK]": words} | kimi.SPECIAL_TOKENS
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", additional_special_tokens=["<|im_end|>", "[EOS]"]
    )
    fast.save_pretrained(directory)


def test_text_prompts_and_response_text_use_the_configured_tokenizer(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path, words=50)
    with SimulatorThread(time_scale=2000, tokenizer=str(tmp_path), normal_vocab_size=50, **NEW) as tok_sim:
        out = generate(tok_sim.url, {"text": "w1 w2 w3", "sampling_params": {"max_new_tokens": 30_000}}).json()

    expected = expected_generation([1, 2, 3], {"max_new_tokens": 30_000}, ContentConfig(normal_vocab_size=50))
    assert out["meta_info"]["prompt_tokens"] == 3
    assert out["output_ids"] == expected.output_ids
    words = " ".join(f"w{t}" if t < 50 else "</think>" for t in expected.output_ids[:-1])  # <|im_end|> trimmed
    assert out["text"] == words
