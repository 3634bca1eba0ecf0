"""The client side of SGLang's wire format: request bodies, response validation, error classes."""

from __future__ import annotations

import json

import pytest

from workers.sglang import (
    PermanentError,
    QueueFull,
    ServerFault,
    build_request,
    classify_http_error,
    parse_response,
    parse_server_info,
)


def _response(output_ids: list[int], **meta: object) -> dict[str, object]:
    base = {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 163586},
        "prompt_tokens": 5,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": "default",
    }
    base.update(meta)
    return {"text": "x", "output_ids": output_ids, "meta_info": base}


def test_request_sends_ids_and_explicit_sampling_params() -> None:
    body = build_request([1, 2, 163606], {"max_new_tokens": 10240, "temperature": 1.0, "unused": 3}, "job/p1/a1")
    assert body["input_ids"] == [1, 2, 163606]
    assert body["rid"] == "job/p1/a1"
    assert body["stream"] is False
    assert body["sampling_params"] == {
        "max_new_tokens": 10240,
        "temperature": 1.0,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def test_valid_response_keeps_every_id_including_the_stop_token() -> None:
    gen = parse_response(_response([5, 163607, 9, 163586]), "r1", 100)
    assert gen.output_ids == [5, 163607, 9, 163586]
    assert gen.finish_type == "stop" and gen.finish_matched == "163586"


def test_completion_tokens_mismatch_is_a_server_fault_not_data() -> None:
    with pytest.raises(ServerFault, match="completion_tokens"):
        parse_response(_response([1, 2, 3], completion_tokens=5), "r1", 100)


def test_missing_output_ids_is_a_server_fault() -> None:
    with pytest.raises(ServerFault, match="output_ids"):
        parse_response({"text": "hi", "meta_info": {}}, "r1", 100)


def test_malformed_finish_reason_is_a_server_fault() -> None:
    with pytest.raises(ServerFault, match="finish_reason"):
        parse_response(_response([1], finish_reason="stop"), "r1", 100)


def test_abort_is_retried_unless_it_carries_a_400() -> None:
    with pytest.raises(ServerFault):
        parse_response(_response([1], finish_reason={"type": "abort", "message": "Abort in waiting queue"}), "r", 9)
    with pytest.raises(PermanentError):
        parse_response(_response([1], finish_reason={"type": "abort", "message": "bad", "status_code": 400}), "r", 9)


def test_http_errors_are_classified_like_the_real_server_bodies() -> None:
    queue_full = json.dumps(
        {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503}
    ).encode()
    assert isinstance(classify_http_error(503, queue_full), QueueFull)
    overflow = json.dumps(
        {"error": {"message": "The input (300000 tokens) is longer than the model's context length (262144 tokens)."}}
    ).encode()
    err = classify_http_error(400, overflow)
    assert isinstance(err, PermanentError) and err.error_class == "context_overflow"
    assert isinstance(classify_http_error(500, b"boom"), ServerFault)


def test_server_info_uses_effective_limits_summed_over_dp_ranks() -> None:
    info = parse_server_info(
        {"model_path": "/m", "weight_version": "v2"},
        {
            "max_running_requests": None,
            "reasoning_parser": "kimi_k2",
            "internal_states": [{"effective_max_running_requests_per_dp": 128}] * 2,
        },
    )
    assert info.effective_max_running_requests == 256
    assert info.model_path == "/m" and info.weight_version == "v2" and info.reasoning_parser == "kimi_k2"
