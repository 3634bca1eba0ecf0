"""The marker ids spans are found with: one small value shared by the job record, workers and storage.

It lives in the foundation package because the job record (``thinkfleet.state.job``) derives it and
``storage/spans.py`` consumes it; ``storage.spans`` re-exports it under its old name.

A marker id of ``None`` means "this tokenizer has no such token": it matches no id, so the spans it
would open or close are simply never found (no ``</think>`` → ``has_think_end`` is always false; no
``<|tool_call_begin|>`` → no tool-call spans). A bare ``SpanTokens()`` has no markers at all: the ids of a
job come from its tokenizer, through its record (``JobRecord.span_tokens``, :mod:`thinkfleet.profiles`).

``scheme`` says how reasoning is delimited: ``think`` (``think_start``/``think_end``, Kimi, Qwen3,
DeepSeek, GLM) or ``harmony`` (gpt-oss channels). For harmony the generic roles are filled as
harmony uses them — ``think_end_id`` = ``<|end|>`` (closes the analysis message), ``tool_call_begin_id`` =
``<|channel|>`` (a call span starts at its message's channel), ``tool_call_end_id`` = ``<|call|>`` — and
the harmony-only fields name the rest (see :func:`storage.spans.compute_spans` for the rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinkfleet import kimi


@dataclass(frozen=True)
class SpanTokens:
    """The marker ids spans are found with (None: the job's tokenizer has no such token)."""

    think_start_id: int | None = None
    think_end_id: int | None = None
    tool_section_begin_id: int | None = None
    tool_section_end_id: int | None = None
    tool_call_begin_id: int | None = None
    tool_call_end_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    #: ``think`` or ``harmony`` (thinkfleet.profiles).
    scheme: str = "think"
    #: False: the job runs with ``--no-reasoning-spans`` (think markers None, the reasoning alarm off).
    reasoning_spans: bool = True
    #: Whitespace ids (``\n``, ``\n\n``) a chat template may put after ``think_start`` at the end of a
    #: prompt (Qwen3-Thinking-2507, DeepSeek-R1-0528: ``<think>\n``); see
    #: :func:`storage.spans.prompt_opens_reasoning`. Empty: only a prompt ending exactly with it opens.
    prompt_trailing_ids: tuple[int, ...] = ()
    # -- harmony only --------------------------------------------------------------------------------
    message_start_id: int | None = None  # <|start|>
    message_id: int | None = None  # <|message|>
    return_id: int | None = None  # <|return|>
    analysis_channel: tuple[int, ...] = ()  # ids of the channel name "analysis"
    final_channel: tuple[int, ...] = ()  # ids of the channel name "final"


KIMI_TOKENS = SpanTokens(
    think_start_id=kimi.THINK_START,
    think_end_id=kimi.THINK_END,
    tool_section_begin_id=kimi.TOOL_CALLS_SECTION_BEGIN,
    tool_section_end_id=kimi.TOOL_CALLS_SECTION_END,
    tool_call_begin_id=kimi.TOOL_CALL_BEGIN,
    tool_call_end_id=kimi.TOOL_CALL_END,
    stop_token_ids=kimi.DEFAULT_STOP_TOKEN_IDS,
)
"""Kimi-K2/K2.5's marker ids (their ``tokenizer_config.json``): what a job record written before model profiles existed
means (those were Kimi jobs), and the default of helpers that work on Kimi-shaped test data."""
