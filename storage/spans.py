"""Where reasoning, answer and tool calls are inside ``output_ids`` — derived from token ids only.

Text is never parsed: a model family's markers are single special tokens, so a span is a pair of offsets
into ``output_ids`` found by comparing ids. Which ids, and which rules (``think`` markers
or harmony channels), is the job's model profile (:class:`SpanTokens`, from ``JobRecord.span_tokens``;
:mod:`thinkfleet.profiles`). The rules below are written with Kimi's names; Qwen3, DeepSeek and GLM-4.5
follow them with their own markers. Conventions, all half-open ``[start, end)``:

- ``reasoning``: the reasoning tokens, markers excluded. When the prompt opens reasoning — it ends with
  ``<think>``, or with ``<think>`` and a newline as Qwen3-Thinking-2507 and DeepSeek-R1-0528 render it
  (:func:`prompt_opens_reasoning`) — the model starts inside reasoning, so it starts at 0; otherwise it
  starts after the first ``<think>`` the model emits, and is empty (0:0) if it emits none. It ends at the
  first ``</think>`` or at ``<|tool_calls_section_begin|>`` (Kimi may go straight from thinking to tool
  calls, which ends reasoning without ``</think>``), else at the end of the output minus a trailing stop token
  (truncated: ``finish_reason == "length"``). ``has_think_end`` is true only if ``</think>`` itself
  closed the reasoning: then ``output_ids[reasoning_end] == think_end_id``. It is false when the
  reasoning ended otherwise, and when reasoning was never opened (a stray ``</think>`` in an
  output whose prompt and tokens never opened reasoning belongs to the answer).
- ``answer``: after ``</think>`` up to the tool-call section or the stop token. Empty, placed at
  ``reasoning_end``, when reasoning was ended by the tool section; empty at the end when truncated.
  With no reasoning at all (thinking off) the answer starts at 0.
- ``tool_call_spans``: one ``(start, end)`` per ``<|tool_call_begin|>``, from that token (included)
  to just after its ``<|tool_call_end|>`` (included), so ``output_ids[start:end]`` is the whole
  call with its markers. A call cut off by truncation ends at the next call begin, section end, or
  end of output (minus a stop token); it is complete iff ``output_ids[end - 1] == tool_call_end_id``.
- ``stop_token``: the final id if it is one of ``stop_token_ids`` (SGLang keeps the matched stop
  token in ``output_ids``), else ``None``.

A marker id of ``None`` (the job's tokenizer has no such token) matches nothing: with no
``</think>`` reasoning ends only at the tool section or the end, and with no tool-call markers a
row has no tool-call spans. A family without a tool section (Qwen3's and GLM-4.5's bare
``<tool_call>`` … ``</tool_call>``) ends the answer at its first tool-call begin instead.

Harmony (gpt-oss, ``SpanTokens.scheme == "harmony"``): the output is a series of messages
``[<|start|>role]<|channel|>CHANNEL …<|message|>CONTENT`` ended by ``<|end|>``, ``<|return|>`` or
``<|call|>`` (the first message's ``<|start|>assistant`` is the prompt's last ids). Then:

- ``reasoning``: the content of the first ``analysis`` message (after its ``<|message|>``, up to its
  terminator); ``has_think_end`` when ``<|end|>`` closed it (``output_ids[reasoning_end]`` is
  ``<|end|>``, the job's ``think_end_id``). Cut off: it runs to the end (minus a stop token). No
  analysis message: empty at 0.
- ``answer``: the content of the first ``final`` message after the reasoning (``<|return|>``, a stop
  token, excluded); empty at the end of the body when there is none (a tool call, a truncation).
- ``tool_call_spans``: every message ended by ``<|call|>`` (a message addressed ``to=`` a tool), from its
  ``<|channel|>`` to its ``<|call|>`` included — the channel header with the recipient, the arguments and
  the markers. A call cut off before its ``<|call|>`` (the output ends inside the message: in its header
  or its arguments, on a channel that is neither ``analysis`` nor ``final``) runs to the end of the output
  (minus a stop token), as a cut-off think-scheme call does: complete iff ``output_ids[end - 1]`` is
  ``<|call|>``. (A commentary *preamble* cut off the same way cannot be told from a call by ids alone; it
  is spanned as a cut-off call too.)

The batch function works on a whole group commit at once (flat ids + offsets): the ids are scanned
with a handful of vectorized comparisons and only the few marker positions are looked at further,
so the cost per row is a few nanoseconds per token with no Python loop over ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from thinkfleet import kimi
from thinkfleet.tokens import KIMI_TOKENS, SpanTokens

__all__ = [
    "KIMI_TOKENS",
    "SpanArrays",
    "SpanTokens",
    "Spans",
    "compute_spans",
    "compute_spans_batch",
    "harmony_spans",
    "ids_at",
    "prompt_opens_reasoning",
    "prompts_open_reasoning",
]

#: Whitespace ids (``SpanTokens.prompt_trailing_ids``) that may follow ``<think>`` at the end of a prompt that
#: opens reasoning, at most: templates write one ``\n`` (two tokens leave room for ``\n`` ``\n``).
MAX_PROMPT_TRAILING = 2


def prompt_opens_reasoning(input_ids: Sequence[int] | np.ndarray, tokens: SpanTokens) -> bool:
    """True when the prompt leaves the model inside reasoning: its last ids are ``think_start`` followed by at
    most :data:`MAX_PROMPT_TRAILING` whitespace ids (``tokens.prompt_trailing_ids``). Kimi-K2.5 ends the
    generation prompt with ``<think>``; Qwen3-Thinking-2507 and DeepSeek-R1-0528 with ``<think>\\n``. Then the
    output holds no ``<think>`` of its own and ``reasoning_start`` is 0. The one rule every reader applies
    (worker rows, the schema, row checks, the reasoning alarm); :func:`prompts_open_reasoning` is its batch twin.
    """
    start = tokens.think_start_id
    if start is None:
        return False
    n = len(input_ids)
    for k in range(1, min(n, MAX_PROMPT_TRAILING + 1) + 1):
        token = int(input_ids[n - k])
        if token == start:
            return True
        if token not in tokens.prompt_trailing_ids:
            return False
    return False


def prompts_open_reasoning(values: np.ndarray, offsets: np.ndarray, tokens: SpanTokens) -> np.ndarray:
    """:func:`prompt_opens_reasoning` of every prompt stored flat (row ``i`` = ``values[offsets[i]:offsets[i+1]]``)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    opens = np.zeros(len(lengths), dtype=bool)
    if tokens.think_start_id is None:
        return opens
    trailing = np.asarray(tokens.prompt_trailing_ids, dtype=np.int64)
    undecided = np.ones(len(lengths), dtype=bool)
    for k in range(1, MAX_PROMPT_TRAILING + 2):
        at = ids_at(values, offsets, lengths - k)  # -1 before the prompt's start
        hit = undecided & (at == tokens.think_start_id)
        opens |= hit
        undecided &= ~hit & np.isin(at, trailing)
        if not undecided.any():
            break
    return opens


@dataclass(frozen=True)
class Spans:
    """Spans of one output (see the module docstring for the exact conventions)."""

    reasoning_start: int
    reasoning_end: int
    has_think_end: bool
    answer_start: int
    answer_end: int
    tool_call_spans: tuple[tuple[int, int], ...]
    stop_token: int | None


@dataclass(frozen=True)
class SpanArrays:
    """Spans of a batch, one entry per row; tool calls as a flat list with per-row offsets."""

    reasoning_start: np.ndarray  # int32
    reasoning_end: np.ndarray  # int32
    has_think_end: np.ndarray  # bool
    answer_start: np.ndarray  # int32
    answer_end: np.ndarray  # int32
    tool_call_offsets: np.ndarray  # int32, len rows + 1
    tool_call_starts: np.ndarray  # int32
    tool_call_ends: np.ndarray  # int32
    stop_token: np.ndarray  # int64, -1 where the row has no stop token

    def row(self, i: int) -> Spans:
        lo, hi = int(self.tool_call_offsets[i]), int(self.tool_call_offsets[i + 1])
        stop = int(self.stop_token[i])
        return Spans(
            reasoning_start=int(self.reasoning_start[i]),
            reasoning_end=int(self.reasoning_end[i]),
            has_think_end=bool(self.has_think_end[i]),
            answer_start=int(self.answer_start[i]),
            answer_end=int(self.answer_end[i]),
            tool_call_spans=tuple(
                zip(self.tool_call_starts[lo:hi].tolist(), self.tool_call_ends[lo:hi].tolist(), strict=True)
            ),
            stop_token=None if stop < 0 else stop,
        )


def compute_spans(
    output_ids: Sequence[int] | np.ndarray,
    *,
    prompt_ends_with_think_start: bool = True,
    think_start_id: int | None = kimi.THINK_START,
    think_end_id: int | None = kimi.THINK_END,
    tool_section_begin_id: int | None = kimi.TOOL_CALLS_SECTION_BEGIN,
    tool_section_end_id: int | None = kimi.TOOL_CALLS_SECTION_END,
    tool_call_begin_id: int | None = kimi.TOOL_CALL_BEGIN,
    tool_call_end_id: int | None = kimi.TOOL_CALL_END,
    stop_token_ids: Sequence[int] = kimi.DEFAULT_STOP_TOKEN_IDS,
    scheme: str = "think",
    reasoning_spans: bool = True,
    message_start_id: int | None = None,
    message_id: int | None = None,
    return_id: int | None = None,
    analysis_channel: Sequence[int] = (),
    final_channel: Sequence[int] = (),
    prompt_trailing_ids: Sequence[int] = (),
) -> Spans:
    """Spans of one output: one vectorized scan for markers, then plain logic over the few found.

    This is the readable statement of the rules; :func:`compute_spans_batch` is its vectorized twin
    and the property tests hold the two equal. The keywords are :class:`SpanTokens`' fields
    (``compute_spans(ids, **asdict(tokens))``); ``scheme="harmony"`` applies gpt-oss's channel rules.
    ``prompt_ends_with_think_start`` is :func:`prompt_opens_reasoning` of the prompt (``prompt_trailing_ids``
    is only what that helper reads).
    """
    # An explicit dtype skips numpy's type inference over a Python list (a third of the cost).
    ids = output_ids if isinstance(output_ids, np.ndarray) else np.array(output_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"output_ids must be one sequence of ids, got shape {ids.shape}")
    if scheme == "harmony":
        return harmony_spans(
            ids,
            SpanTokens(
                think_end_id=think_end_id,
                tool_call_begin_id=tool_call_begin_id,
                tool_call_end_id=tool_call_end_id,
                stop_token_ids=tuple(stop_token_ids),
                scheme=scheme,
                reasoning_spans=reasoning_spans,
                message_start_id=message_start_id,
                message_id=message_id,
                return_id=return_id,
                analysis_channel=tuple(analysis_channel),
                final_channel=tuple(final_channel),
            ),
        )
    n = len(ids)
    last = int(ids[-1]) if n else None
    stop_token = last if last is not None and last in stop_token_ids else None
    body_end = n - (stop_token is not None)

    # A None marker (no such token) is left out, so it is never found; `t in (None,)` is false too.
    markers = tuple(
        m
        for m in (
            think_start_id,
            think_end_id,
            tool_section_begin_id,
            tool_section_end_id,
            tool_call_begin_id,
            tool_call_end_id,
        )
        if m is not None
    )
    body = ids[:body_end]
    marks: list[tuple[int, int]] = []
    if markers:
        pos = np.flatnonzero((body >= min(markers)) & (body <= max(markers)))
        marks = [(p, t) for p, t in zip(pos.tolist(), body[pos].tolist(), strict=True) if t in markers]

    def first(wanted: tuple[int, ...], start: int) -> tuple[int, int] | None:
        return next(((p, t) for p, t in marks if p >= start and t in wanted), None)

    reasoning_start = reasoning_end = answer_start = 0
    has_think_end = False
    opened = prompt_ends_with_think_start or first((think_start_id,), 0) is not None
    if opened:
        if not prompt_ends_with_think_start:
            reasoning_start = first((think_start_id,), 0)[0] + 1  # type: ignore[index]
        end = first((think_end_id, tool_section_begin_id), reasoning_start)
        if end is None:  # truncated inside reasoning
            reasoning_end = answer_start = body_end
        else:
            reasoning_end = end[0]
            has_think_end = end[1] == think_end_id
            answer_start = reasoning_end + 1 if has_think_end else reasoning_end
    # The answer ends where tool calls start: the section, or (no section marker) the first call.
    area = tool_section_begin_id if tool_section_begin_id is not None else tool_call_begin_id
    section = first((area,), answer_start)
    answer_end = section[0] if section else body_end

    calls: list[tuple[int, int]] = []
    for i, (p, t) in enumerate(marks):
        if t != tool_call_begin_id:
            continue
        end_at = body_end
        for q, u in marks[i + 1 :]:
            if u in (tool_call_begin_id, tool_section_end_id):
                end_at = q  # cut off: the call runs to the next call or the section end
                break
            if u == tool_call_end_id:
                end_at = q + 1
                break
        calls.append((p, end_at))

    return Spans(
        reasoning_start=reasoning_start,
        reasoning_end=reasoning_end,
        has_think_end=has_think_end,
        answer_start=answer_start,
        answer_end=answer_end,
        tool_call_spans=tuple(calls),
        stop_token=stop_token,
    )


def ids_at(
    values: np.ndarray, offsets: np.ndarray, positions: np.ndarray, rows: np.ndarray | None = None
) -> np.ndarray:
    """The id at a row-local position (int64), or -1 where the position is outside its row.

    One position per row, or per entry of ``rows`` when given. Gathers without copying ``values``
    (no padding sentinel): a batch may hold millions of ids.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    if rows is not None:
        starts, lengths = starts[rows], lengths[rows]
    inside = (positions >= 0) & (positions < lengths)
    out = np.full(len(positions), -1, dtype=np.int64)
    out[inside] = values[starts[inside] + positions[inside]]
    return out


def compute_spans_batch(
    values: np.ndarray,
    offsets: np.ndarray,
    prompt_ends_with_think_start: bool | np.ndarray = True,
    tokens: SpanTokens = KIMI_TOKENS,
) -> SpanArrays:
    """Spans of many outputs stored flat: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``prompt_ends_with_think_start`` is one bool for all rows or a bool array (one per row); a
    harmony job (``tokens.scheme``) ignores it.
    """
    if tokens.scheme == "harmony":
        return _harmony_batch(values, offsets, tokens)
    offsets = np.asarray(offsets, dtype=np.int64)
    n_rows = len(offsets) - 1
    lengths = np.diff(offsets)
    row_start = offsets[:-1]
    pets = np.broadcast_to(np.asarray(prompt_ends_with_think_start, dtype=bool), (n_rows,))

    # A trailing stop token is kept in output_ids by SGLang; it belongs to no span.
    last = ids_at(values, offsets, lengths - 1)
    has_stop = (lengths > 0) & np.isin(last, np.asarray(tokens.stop_token_ids, dtype=np.int64))
    stop_token = np.where(has_stop, last, -1).astype(np.int64)
    body_end = lengths - has_stop

    # The few marker positions, with their row and offset inside the row. One range test over all
    # ids first (markers are adjacent ids in Kimi), then exact matching on the few survivors.
    t = tokens
    present = [
        m
        for m in (
            t.think_start_id,
            t.think_end_id,
            t.tool_section_begin_id,
            t.tool_section_end_id,
            t.tool_call_begin_id,
            t.tool_call_end_id,
        )
        if m is not None  # the tokenizer has no such token: it is never found
    ]
    markers = np.array(present, dtype=np.int64)
    if len(markers):
        cand = np.flatnonzero((values >= markers.min()) & (values <= markers.max()))
    else:
        cand = np.zeros(0, dtype=np.int64)
    kind = values[cand].astype(np.int64)
    keep = np.isin(kind, markers)
    cand, kind = cand[keep], kind[keep]
    crow = np.searchsorted(offsets, cand, side="right") - 1
    cpos = cand - row_start[crow]
    in_body = cpos < body_end[crow]
    cand, kind, crow, cpos = cand[in_body], kind[in_body], crow[in_body], cpos[in_body]

    def eq(ids: np.ndarray, marker: int | None) -> np.ndarray:
        """``ids == marker``, elementwise; a None marker (no such token) equals nothing."""
        return ids == marker if marker is not None else np.zeros(len(ids), dtype=bool)

    def first(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: (found, position, id) of the first marker selected by ``mask``."""
        idx = np.flatnonzero(mask)
        rows = crow[idx]
        head = np.ones(len(idx), dtype=bool)
        head[1:] = rows[1:] != rows[:-1]  # candidates are in id order, so rows are sorted
        idx, rows = idx[head], rows[head]
        found = np.zeros(n_rows, dtype=bool)
        pos = np.zeros(n_rows, dtype=np.int64)
        ids = np.full(n_rows, -1, dtype=np.int64)
        found[rows], pos[rows], ids[rows] = True, cpos[idx], kind[idx]
        return found, pos, ids

    # Reasoning start: 0 after a prompt-side <think>, else after the model's own first <think>.
    ts_found, ts_pos, _ = first(eq(kind, t.think_start_id))
    in_reasoning = pets | ts_found
    reasoning_start = np.where(pets, 0, np.where(ts_found, ts_pos + 1, 0))

    # Reasoning end: the first </think> or tool-section begin at or after the start.
    ender = eq(kind, t.think_end_id) | eq(kind, t.tool_section_begin_id)
    end_found, end_pos, end_id = first(ender & in_reasoning[crow] & (cpos >= reasoning_start[crow]))
    has_think_end = eq(end_id, t.think_end_id)
    reasoning_end = np.where(in_reasoning, np.where(end_found, end_pos, body_end), 0)
    answer_start = np.where(
        in_reasoning, np.where(has_think_end, end_pos + 1, np.where(end_found, end_pos, body_end)), 0
    )

    # Answer end: the tool-call section (no section marker: the first call), else the stop token / end.
    area = t.tool_section_begin_id if t.tool_section_begin_id is not None else t.tool_call_begin_id
    sec_found, sec_pos, _ = first(eq(kind, area) & (cpos >= answer_start[crow]))
    answer_end = np.where(sec_found, sec_pos, body_end)

    # Tool calls: each begin pairs with the first end before the next begin / section end / body end.
    # A sentinel past every id keeps the searches in range without special cases.
    never = np.iinfo(np.int64).max
    is_begin = eq(kind, t.tool_call_begin_id)
    begin, begin_row = cand[is_begin], crow[is_begin]
    barrier_mask = is_begin | eq(kind, t.tool_section_end_id)
    barrier = np.append(cand[barrier_mask], never)
    barrier_row = np.append(crow[barrier_mask], -1)
    k = np.searchsorted(barrier, begin, side="right")
    limit = np.where(barrier_row[k] == begin_row, barrier[k], row_start[begin_row] + body_end[begin_row])
    ends = np.append(cand[eq(kind, t.tool_call_end_id)], never)
    next_end = ends[np.searchsorted(ends, begin, side="right")]
    call_end = np.where(next_end < limit, next_end + 1, limit)
    tool_offsets = np.zeros(n_rows + 1, dtype=np.int32)
    np.cumsum(np.bincount(begin_row, minlength=n_rows), out=tool_offsets[1:])

    i32 = np.int32
    return SpanArrays(
        reasoning_start=reasoning_start.astype(i32),
        reasoning_end=reasoning_end.astype(i32),
        has_think_end=has_think_end,
        answer_start=answer_start.astype(i32),
        answer_end=answer_end.astype(i32),
        tool_call_offsets=tool_offsets,
        tool_call_starts=(begin - row_start[begin_row]).astype(i32),
        tool_call_ends=(call_end - row_start[begin_row]).astype(i32),
        stop_token=stop_token,
    )


# -- harmony (gpt-oss): channel-delimited messages ----------------------------------------------------------
def harmony_spans(output_ids: Sequence[int] | np.ndarray, tokens: SpanTokens) -> Spans:
    """Spans of one harmony output (rules in the module docstring); ``tokens.scheme`` must be ``harmony``."""
    ids = output_ids if isinstance(output_ids, np.ndarray) else np.array(output_ids, dtype=np.int64)
    t = tokens
    n = len(ids)
    last = int(ids[-1]) if n else None
    stop_token = last if last is not None and last in t.stop_token_ids else None
    body_end = n - (stop_token is not None)

    start, channel, message = t.message_start_id, t.tool_call_begin_id, t.message_id
    end, ret, call = t.think_end_id, t.return_id, t.tool_call_end_id
    enders = tuple(m for m in (end, ret, call) if m is not None)
    control = [m for m in (start, channel, message, *enders) if m is not None]
    marks: list[tuple[int, int]] = []
    if control and n:
        lo, hi = min(control), max(control)
        pos = np.flatnonzero((ids >= lo) & (ids <= hi))
        marks = [(p, v) for p, v in zip(pos.tolist(), ids[pos].tolist(), strict=True) if v in control]

    # (channel position or None, <|message|> position, content end, terminator id or None)
    messages: list[tuple[int | None, int, int, int | None]] = []
    at_channel: int | None = None
    at_message: int | None = None
    for p, v in marks:
        if v == start:
            if at_message is not None:  # a new header while a message is open: it was cut here
                messages.append((at_channel, at_message, p, None))
            at_channel = at_message = None
        elif v == channel:
            if at_message is None and at_channel is None:
                at_channel = p
        elif v == message:
            if at_message is None:
                at_message = p
        elif v in enders and at_message is not None:
            messages.append((at_channel, at_message, p, v))
            at_channel = at_message = None
    tail = (at_channel, at_message)  # the message the output ends inside (cut off), if any
    if at_message is not None:
        messages.append((at_channel, at_message, n, None))

    def on_channel(ch: int | None, msg: int, name: tuple[int, ...]) -> bool:
        if ch is None or not name or msg - ch - 1 < len(name):
            return False
        return tuple(ids[ch + 1 : ch + 1 + len(name)].tolist()) == name

    def cut_call(ch: int | None, msg: int | None) -> bool:
        """The output ends inside this message, whose channel is known to be neither analysis nor final."""
        if ch is None or ch >= body_end:
            return False
        header = tuple(ids[ch + 1 : body_end if msg is None else msg].tolist())
        named = (t.analysis_channel, t.final_channel)
        return bool(header) and not any(header[: len(name)] == name[: len(header)] for name in named if name)

    reasoning_start = reasoning_end = 0
    has_think_end = False
    for ch, msg, content_end, term in messages:
        if on_channel(ch, msg, t.analysis_channel):
            reasoning_start = min(msg + 1, body_end)
            reasoning_end = min(content_end, body_end)
            has_think_end = term is not None and term == end and content_end < body_end
            break
    answer_start = answer_end = body_end
    for ch, msg, content_end, _ in messages:
        if msg >= reasoning_end and on_channel(ch, msg, t.final_channel):
            answer_start = min(msg + 1, body_end)
            answer_end = min(content_end, body_end)
            break
    calls = tuple((ch, content_end + 1) for ch, _, content_end, term in messages if ch is not None and term == call)
    if cut_call(*tail):
        calls += ((tail[0], body_end),)
    return Spans(
        reasoning_start=reasoning_start,
        reasoning_end=reasoning_end,
        has_think_end=has_think_end,
        answer_start=answer_start,
        answer_end=answer_end,
        tool_call_spans=calls,
        stop_token=stop_token,
    )


def _harmony_batch(values: np.ndarray, offsets: np.ndarray, tokens: SpanTokens) -> SpanArrays:
    """:func:`harmony_spans` row by row (harmony outputs hold a handful of control tokens; the scan for
    them is vectorized per row, the message walk is a short Python loop)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    n_rows = len(offsets) - 1
    cols = {k: np.zeros(n_rows, dtype=np.int32) for k in ("rs", "re", "as", "ae")}
    hte = np.zeros(n_rows, dtype=bool)
    stop = np.full(n_rows, -1, dtype=np.int64)
    counts = np.zeros(n_rows, dtype=np.int64)
    starts: list[int] = []
    ends: list[int] = []
    for i in range(n_rows):
        s = harmony_spans(values[offsets[i] : offsets[i + 1]], tokens)
        cols["rs"][i], cols["re"][i] = s.reasoning_start, s.reasoning_end
        cols["as"][i], cols["ae"][i] = s.answer_start, s.answer_end
        hte[i] = s.has_think_end
        stop[i] = -1 if s.stop_token is None else s.stop_token
        counts[i] = len(s.tool_call_spans)
        for a, b in s.tool_call_spans:
            starts.append(a)
            ends.append(b)
    tool_offsets = np.zeros(n_rows + 1, dtype=np.int32)
    np.cumsum(counts, out=tool_offsets[1:])
    return SpanArrays(
        reasoning_start=cols["rs"],
        reasoning_end=cols["re"],
        has_think_end=hte,
        answer_start=cols["as"],
        answer_end=cols["ae"],
        tool_call_offsets=tool_offsets,
        tool_call_starts=np.asarray(starts, dtype=np.int32),
        tool_call_ends=np.asarray(ends, dtype=np.int32),
        stop_token=stop,
    )
