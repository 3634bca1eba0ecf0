"""Spans from real Kimi token sequences, and properties over generated ones."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.spans import KIMI_TOKENS, Spans, compute_spans, compute_spans_batch
from thinkfleet import kimi

R = [11, 12, 13]  # reasoning tokens
A = [21, 22]  # answer tokens


def test_reasoning_then_answer_then_stop() -> None:
    ids = [*R, kimi.THINK_END, *A, kimi.IM_END]
    s = compute_spans(ids)
    assert ids[s.reasoning_start : s.reasoning_end] == R
    assert s.has_think_end and ids[s.reasoning_end] == kimi.THINK_END
    assert ids[s.answer_start : s.answer_end] == A
    assert s.stop_token == kimi.IM_END
    assert s.tool_call_spans == ()


def test_answer_with_tool_calls() -> None:
    call1 = [kimi.TOOL_CALL_BEGIN, 31, kimi.TOOL_CALL_ARGUMENT_BEGIN, 32, 33, kimi.TOOL_CALL_END]
    call2 = [kimi.TOOL_CALL_BEGIN, 41, kimi.TOOL_CALL_ARGUMENT_BEGIN, 42, kimi.TOOL_CALL_END]
    section = [kimi.TOOL_CALLS_SECTION_BEGIN, *call1, *call2, kimi.TOOL_CALLS_SECTION_END]
    ids = [*R, kimi.THINK_END, *A, *section, kimi.IM_END]
    s = compute_spans(ids)
    assert ids[s.answer_start : s.answer_end] == A
    assert [ids[a:b] for a, b in s.tool_call_spans] == [call1, call2]
    assert s.stop_token == kimi.IM_END


def test_truncated_without_think_end_is_all_reasoning() -> None:
    ids = [*R, 14, 15]  # finish_reason=length: no stop token, no </think>
    s = compute_spans(ids)
    assert (s.reasoning_start, s.reasoning_end) == (0, len(ids))
    assert not s.has_think_end
    assert s.answer_start == s.answer_end == len(ids)
    assert s.stop_token is None


def test_tool_section_directly_after_reasoning_ends_reasoning() -> None:
    call = [kimi.TOOL_CALL_BEGIN, 31, kimi.TOOL_CALL_ARGUMENT_BEGIN, 32, kimi.TOOL_CALL_END]
    ids = [*R, kimi.TOOL_CALLS_SECTION_BEGIN, *call, kimi.TOOL_CALLS_SECTION_END, kimi.IM_END]
    s = compute_spans(ids)
    assert ids[s.reasoning_start : s.reasoning_end] == R
    assert not s.has_think_end
    assert s.answer_start == s.answer_end == len(R)  # empty answer, at the section
    assert [ids[a:b] for a, b in s.tool_call_spans] == [call]


def test_prompt_without_think_start_finds_reasoning_in_output() -> None:
    ids = [kimi.THINK_START, *R, kimi.THINK_END, *A, kimi.EOS]
    s = compute_spans(ids, prompt_ends_with_think_start=False)
    assert ids[s.reasoning_start : s.reasoning_end] == R
    assert s.has_think_end
    assert ids[s.answer_start : s.answer_end] == A
    assert s.stop_token == kimi.EOS


def test_prompt_without_think_start_and_no_thinking_is_all_answer() -> None:
    ids = [*A, kimi.IM_END]  # thinking off: the prompt ended with <think></think>
    s = compute_spans(ids, prompt_ends_with_think_start=False)
    assert s.reasoning_start == s.reasoning_end == 0
    assert not s.has_think_end
    assert ids[s.answer_start : s.answer_end] == A


def test_truncated_inside_a_tool_call() -> None:
    ids = [*R, kimi.THINK_END, kimi.TOOL_CALLS_SECTION_BEGIN, kimi.TOOL_CALL_BEGIN, 31, 32]
    s = compute_spans(ids)
    (start, end), = s.tool_call_spans  # fmt: skip
    assert (start, end) == (len(R) + 2, len(ids))
    assert ids[end - 1] != kimi.TOOL_CALL_END  # incomplete, and detectable as such


def test_empty_output() -> None:
    assert compute_spans([]) == Spans(0, 0, False, 0, 0, (), None)


def test_numpy_and_list_inputs_agree() -> None:
    ids = [*R, kimi.THINK_END, *A, kimi.IM_END]
    assert compute_spans(np.array(ids, dtype=np.int32)) == compute_spans(ids)


def test_custom_marker_ids() -> None:
    ids = [5, 6, 900, 7, 8, 999]
    s = compute_spans(ids, think_end_id=900, stop_token_ids=(999,))
    assert (s.reasoning_end, s.answer_start, s.answer_end, s.stop_token) == (2, 3, 5, 999)


# -- properties ---------------------------------------------------------------------------------------

MARKERS = [
    kimi.THINK_START,
    kimi.THINK_END,
    kimi.TOOL_CALLS_SECTION_BEGIN,
    kimi.TOOL_CALLS_SECTION_END,
    kimi.TOOL_CALL_BEGIN,
    kimi.TOOL_CALL_ARGUMENT_BEGIN,
    kimi.TOOL_CALL_END,
    kimi.IM_END,
    kimi.EOS,
]
token = st.one_of(st.integers(0, 163_583), st.sampled_from(MARKERS))
outputs = st.lists(token, max_size=60)


@given(outputs, st.booleans())
@settings(max_examples=400, deadline=None)
def test_span_invariants(ids: list[int], pets: bool) -> None:
    s = compute_spans(ids, prompt_ends_with_think_start=pets)
    n = len(ids)
    body_end = n - (s.stop_token is not None)
    assert 0 <= s.reasoning_start <= s.reasoning_end <= body_end
    assert s.reasoning_end <= s.answer_start <= s.answer_end <= body_end
    # Reasoning holds no marker that ends it, and has_think_end is exactly "</think> is next".
    reasoning = ids[s.reasoning_start : s.reasoning_end]
    assert kimi.THINK_END not in reasoning and kimi.TOOL_CALLS_SECTION_BEGIN not in reasoning
    opened = pets or kimi.THINK_START in ids[:body_end]
    closed_by_think_end = s.reasoning_end < n and ids[s.reasoning_end] == kimi.THINK_END
    assert s.has_think_end == (opened and closed_by_think_end)
    if pets:
        assert s.reasoning_start == 0
    assert kimi.TOOL_CALLS_SECTION_BEGIN not in ids[s.answer_start : s.answer_end]
    assert s.stop_token == (ids[-1] if ids and ids[-1] in (kimi.IM_END, kimi.EOS) else None)
    # One tool-call span per call-begin token, in order, never overlapping.
    begins = [i for i, t in enumerate(ids[:body_end]) if t == kimi.TOOL_CALL_BEGIN]
    assert [a for a, _ in s.tool_call_spans] == begins
    limits = [*begins[1:], body_end] if begins else []
    for (a, b), nxt in zip(s.tool_call_spans, limits, strict=True):
        assert a < b <= nxt
        assert kimi.TOOL_CALL_END not in ids[a : b - 1]


@given(st.lists(st.tuples(outputs, st.booleans()), max_size=12))
@settings(max_examples=200, deadline=None)
def test_batch_equals_single(batch: list[tuple[list[int], bool]]) -> None:
    flat = np.array([t for ids, _ in batch for t in ids], dtype=np.int32)
    offsets = np.cumsum([0, *(len(ids) for ids, _ in batch)])
    pets = np.array([p for _, p in batch], dtype=bool)
    arrays = compute_spans_batch(flat, offsets, pets, KIMI_TOKENS)
    for i, (ids, p) in enumerate(batch):
        assert arrays.row(i) == compute_spans(ids, prompt_ends_with_think_start=p)


@given(st.lists(token, min_size=1, max_size=40), st.integers(0, 20))
@settings(max_examples=100, deadline=None)
def test_reasoning_tokens_round_trip(reasoning_noise: list[int], answer_len: int) -> None:
    reasoning = [t for t in reasoning_noise if t not in MARKERS]
    answer = list(range(100, 100 + answer_len))
    ids = [*reasoning, kimi.THINK_END, *answer, kimi.IM_END]
    s = compute_spans(ids)
    assert ids[s.reasoning_start : s.reasoning_end] == reasoning
    assert ids[s.answer_start : s.answer_end] == answer
