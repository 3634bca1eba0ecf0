"""The client side of SGLang's wire format: request bodies, response validation, error classes."""

from __future__ import annotations

import json

import pytest

from workers.sglang import (
    NanStop,
    PermanentError,
    QueueFull,
    RequestLimits,
    ServerAbort,
    ServerFault,
    Unanswered,
    build_request,
    check_request,
    classify_http_error,
    parse_response,
    parse_server_info,
    parse_version,
)

#: meta_info as each deployed profile writes it (docs/sglang-versions.md).
META_0_5_9 = {"total_retractions": 2}  # no reasoning_tokens before 0.5.10; total_retractions up to 0.5.11
META_0_5_23 = {"num_retractions": 1, "reasoning_tokens": 3}


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


@pytest.mark.parametrize(
    ("extra", "retractions", "reasoning"),
    [(META_0_5_9, 2, None), (META_0_5_23, 1, 3), ({}, None, None), ({"reasoning_tokens": 0}, None, 0)],
    ids=["0.5.9", "0.5.23", "neither", "zero-reasoning"],
)
def test_every_meta_info_shape_keeps_what_the_server_said_and_nothing_else(
    extra: dict[str, int], retractions: int | None, reasoning: int | None
) -> None:
    gen = parse_response(_response([5, 163607, 9, 163586], **extra), "r1", 100)
    assert gen.num_retractions == retractions
    assert gen.reasoning_tokens == reasoning, "an absent reasoning_tokens is None (null), never 0"


def test_both_retraction_names_prefer_the_current_one() -> None:
    gen = parse_response(_response([1, 163586], num_retractions=4, total_retractions=9), "r1", 100)
    assert gen.num_retractions == 4


def test_nan_stop_is_a_server_fault_with_its_own_dead_letter_class() -> None:
    nan = _response([5, 6, 163586], finish_reason={"type": "stop", "matched": "NaN happened"})
    with pytest.raises(NanStop) as caught:
        parse_response(nan, "r1", 100)
    assert isinstance(caught.value, ServerFault), "retried like a 503"
    assert caught.value.error_class == "nan_stop" and caught.value.exhausted_class == "nan_stop"
    # A real stop string that merely differs is data.
    gen = parse_response(_response([5, 163586], finish_reason={"type": "stop", "matched": "NaN"}), "r1", 100)
    assert gen.finish_matched == "NaN"


@pytest.mark.parametrize(
    ("finish", "kind", "error_class"),
    [
        ({"type": "abort", "message": "Abort in waiting queue"}, ServerAbort, "server_abort"),
        ({"type": "abort", "message": "x", "status_code": None, "err_type": None}, ServerAbort, "server_abort"),
        ({"type": "abort", "message": "busy", "status_code": 503, "err_type": "ServiceUnavailable"}, QueueFull, None),
        (
            {"type": "abort", "message": "boom", "status_code": 500, "err_type": "InternalServerError"},
            ServerAbort,
            None,
        ),
        ({"type": "abort", "message": "slow down", "status_code": 429, "err_type": None}, ServerAbort, None),
        (
            {"type": "abort", "message": "bad", "status_code": 400, "err_type": "BadRequestError"},
            PermanentError,
            "invalid_request",
        ),
        (
            {
                "type": "abort",
                "message": "The input (9 tokens) is longer than the model's context length (8 tokens).",
                "status_code": 400,
                "err_type": "BadRequestError",
            },
            PermanentError,
            "context_overflow",
        ),
    ],
)
def test_abort_finish_is_classified_by_its_status_code(finish: dict, kind: type, error_class: str | None) -> None:
    with pytest.raises(kind) as caught:
        parse_response(_response([1], finish_reason=finish), "r", 9)
    if error_class is not None:
        assert caught.value.error_class == error_class
    if isinstance(caught.value, PermanentError):
        assert finish["message"] in caught.value.message, "the dead letter keeps the server's message"


def test_no_answer_is_a_server_fault_of_its_own_class() -> None:
    assert isinstance(Unanswered("x"), ServerFault) and Unanswered("x").error_class == "unanswered"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("0.5.9", (0, 5, 9)),
        ("v0.5.23", (0, 5, 23)),
        ("0.5.10rc0", (0, 5, 10)),
        ("0.5.9.post1", (0, 5, 9)),
        (None, None),
    ],
)
def test_versions_parse(text: str | None, version: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == version


def test_server_info_reads_version_vocab_context_and_deterministic_inference() -> None:
    info = parse_server_info(
        {"model_path": "/m", "vocab_size": 163840},
        {
            "version": "0.5.9",
            "context_length": 4096,
            "max_req_input_len": 4091,
            "enable_deterministic_inference": True,
            "internal_states": [{"effective_max_running_requests_per_dp": 8}],
        },
    )
    assert (info.vocab_size, info.context_length, info.max_req_input_len) == (163840, 4096, 4091)
    assert info.deterministic is True and info.version == "0.5.9" and info.context_check_inclusive
    bare = parse_server_info({"model_path": "/m"}, {"version": "0.5.23", "context_length": None})
    assert bare.vocab_size is None and bare.context_length is None and bare.deterministic is None
    assert not bare.context_check_inclusive, "0.5.11+ refuses only input + max_new_tokens > context"


def test_an_id_at_or_above_the_vocabulary_is_refused_by_name() -> None:
    refused = check_request([5, 163840, 7], 10, RequestLimits(vocab_size=163840, vocab_source="from the job record"))
    assert refused is not None and refused.error_class == "invalid_ids"
    assert "163840 at position 1" in refused.message and "from the job record" in refused.message
    assert check_request([5, 163839], 10, RequestLimits(vocab_size=163840)) is None
    assert check_request([5, 10**9], 10, RequestLimits()) is None, "unknown vocabulary: nothing checked"


@pytest.mark.parametrize(("inclusive", "refused_at"), [(True, 100), (False, 101)], ids=["0.5.9", "0.5.23"])
def test_context_boundary_follows_the_server_version(inclusive: bool, refused_at: int) -> None:
    limits = RequestLimits(context_length=100, context_check_inclusive=inclusive)
    ids = [1] * 60
    assert check_request(ids, refused_at - 60 - 1, limits) is None
    refused = check_request(ids, refused_at - 60, limits)
    assert refused is not None and refused.error_class == "context_overflow"
    assert f"60 tokens + max_new_tokens {refused_at - 60} = {refused_at} tokens" in refused.message
    assert "context length" in refused.message
    alone = check_request([1] * 100, None, limits)
    assert alone is not None and alone.error_class == "context_overflow"
    capped = check_request([1] * 50, None, RequestLimits(max_req_input_len=50))
    assert capped is not None and "maximum input length of 50" in capped.message


def test_error_bodies_of_both_releases_keep_their_message() -> None:
    contract = json.dumps({"error": "unknown field `hot`, expected one of `max_new_tokens`"}).encode()
    err = classify_http_error(400, contract)  # 0.5.22+: the error is a string
    assert isinstance(err, PermanentError) and err.message.startswith("unknown field `hot`")
    assert isinstance(classify_http_error(500, b"Internal Server Error"), ServerFault)  # 0.5.9's TypeError


def test_the_effective_context_length_comes_from_v1_models() -> None:
    info = parse_server_info(
        {"model_path": "/m"},
        {"version": "0.5.9", "context_length": None, "max_req_input_len": 262137},
        {"object": "list", "data": [{"id": "/m", "max_model_len": 262144}]},
    )
    assert info.context_length == 262144 and info.max_req_input_len == 262137
