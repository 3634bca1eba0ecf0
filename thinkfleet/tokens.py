"""The marker ids spans are found with: one small value shared by the job record, workers and storage.

It lives in the foundation package because the job record (``thinkfleet.state.job``) derives it and
``storage/spans.py`` consumes it; ``storage.spans`` re-exports it under its old name.

A marker id of ``None`` means "this tokenizer has no such token": it matches no id, so the spans it
would open or close are simply never found (no ``</think>`` → ``has_think_end`` is always false; no
``<|tool_call_begin|>`` → no tool-call spans).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinkfleet import kimi


@dataclass(frozen=True)
class SpanTokens:
    """The marker ids spans are found with (Kimi's by default; a job record may name others, or None)."""

    think_start_id: int | None = kimi.THINK_START
    think_end_id: int | None = kimi.THINK_END
    tool_section_begin_id: int | None = kimi.TOOL_CALLS_SECTION_BEGIN
    tool_section_end_id: int | None = kimi.TOOL_CALLS_SECTION_END
    tool_call_begin_id: int | None = kimi.TOOL_CALL_BEGIN
    tool_call_end_id: int | None = kimi.TOOL_CALL_END
    stop_token_ids: tuple[int, ...] = kimi.DEFAULT_STOP_TOKEN_IDS


KIMI_TOKENS = SpanTokens()
