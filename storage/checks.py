"""Row-level integrity checks of stored rows, vectorized over a whole table.

A row is malformed when its spans or counts contradict its own ``output_ids``: the spans are a pure
function of the ids (storage/spans.py), so they are recomputed and compared, and the structural
rules are checked on their own too so the message says what is wrong.

A row's ids are also checked against what was computed from them before they were stored, each recomputed here
and never taken from the row or the message: :func:`hash_mismatches` (``input_ids`` against ``content_hash``:
injected or corrupted prompts) and :func:`checksum_mismatches` (the ids against ``ids_crc32``: altered in
storage). Like :func:`row_problems`, each needs only the table in hand, so ``producer verify`` (storage/verify.py)
runs them all over the committed rows a batch at a time.

An image prompt's row is checked against its own ids too (:func:`image_problems`): one placeholder per image, at
the positions the row records, and nowhere else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from storage.schema import (
    ANSWER_END,
    ANSWER_START,
    COMPLETION_TOKENS,
    CONTENT_HASH,
    EXPANDED_INPUT_IDS,
    FINISH_REASON,
    HAS_THINK_END,
    IDS_CRC32,
    IMAGE_PATHS,
    IMAGE_POSITIONS,
    IMAGE_SHA256,
    IMAGE_TOKENS,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    REASONING_SPAN_COLUMNS,
    REASONING_START,
    SPAN_COLUMNS,
    STOP_TOKEN,
    TOKEN_COLUMNS,
    TOOL_CALL_SPANS,
    table_ids_checksums,
)
from storage.spans import SpanTokens, compute_spans_batch, ids_at, prompts_open_reasoning
from thinkfleet.message import hash_id_bytes, is_content_hash

#: Columns :func:`row_problems` needs.
CHECK_COLUMNS = [PROMPT_ID, *TOKEN_COLUMNS, *SPAN_COLUMNS, STOP_TOKEN, COMPLETION_TOKENS, FINISH_REASON]
#: Columns :func:`image_problems` needs.
IMAGE_CHECK_COLUMNS = [
    PROMPT_ID, INPUT_IDS, IMAGE_SHA256, IMAGE_PATHS, IMAGE_TOKENS, IMAGE_POSITIONS, EXPANDED_INPUT_IDS
]  # fmt: skip
FINISH_TYPES = ("stop", "length", "abort")


@dataclass
class ThinkingStats:
    """For the seed's bug: rows expected to reason, and how many outputs closed their reasoning."""

    #: the prompt opens reasoning (ends with <think>, maybe + a newline), or the job's model opens it itself in
    #: thinking mode (``thinkfleet.profiles.expects_reasoning``: Qwen3/GLM-4.5 with enable_thinking, gpt-oss)
    thinking_rows: int = 0
    think_end_rows: int = 0  # … and the output has </think>

    def add(self, other: ThinkingStats) -> None:
        self.thinking_rows += other.thinking_rows
        self.think_end_rows += other.think_end_rows


def flat_ids(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list<int32> column → (flat ids, int64 offsets) without copying per row."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy().astype(np.int64)
    # A sliced array shares its parent's values: cut them to this slice and rebase the offsets.
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return values, offsets - offsets[0]


def row_problems(
    table: pa.Table, tokens: SpanTokens, reasoning_expected: bool = False
) -> tuple[dict[str, list[str]], ThinkingStats]:
    """``{prompt_id: [problem, …]}`` for every malformed row, and the thinking statistics.

    ``reasoning_expected``: every row should reason whatever its prompt (``thinkfleet.profiles.expects_reasoning``
    of the job); otherwise only the rows whose prompt opens reasoning count as thinking rows."""
    values, offsets = flat_ids(table[OUTPUT_IDS])
    in_values, in_offsets = flat_ids(table[INPUT_IDS])
    n = np.diff(offsets)
    # Null reasoning/answer spans are "not recorded" (--no-reasoning-spans): right in such a job, wrong in
    # one that records them. A job without reasoning spans checks none (its older rows hold 0:0).
    recorded = np.ones(len(n), dtype=bool)
    for c in REASONING_SPAN_COLUMNS:
        recorded &= table[c].is_valid().to_numpy(zero_copy_only=False)
    checked = recorded if tokens.reasoning_spans else np.zeros(len(n), dtype=bool)
    col = {c: table[c].fill_null(0).to_numpy() for c in (REASONING_START, REASONING_END, ANSWER_START, ANSWER_END)}
    rs, re, as_, ae = col[REASONING_START], col[REASONING_END], col[ANSWER_START], col[ANSWER_END]
    hte = table[HAS_THINK_END].fill_null(False).to_numpy()
    found: dict[int, list[str]] = defaultdict(list)

    def flag(mask: np.ndarray, problem: str) -> None:
        for i in np.flatnonzero(mask).tolist():
            found[i].append(problem)

    if tokens.reasoning_spans:
        flag(~recorded, "reasoning/answer spans are null (not recorded) but the job records them")
    flag(checked & (re < rs), "reasoning_end < reasoning_start")
    flag(checked & ((rs < 0) | (re > n)), "reasoning span out of range")
    flag(checked & ((as_ < 0) | (ae > n) | (ae < as_)), "answer span out of range")
    flag(checked & (as_ < re), "answer starts inside reasoning")
    flag(table[COMPLETION_TOKENS].to_numpy() != n, "completion_tokens != len(output_ids)")
    at_end = ids_at(values, offsets, re)
    flag(checked & hte & (at_end != tokens.think_end_id), "has_think_end but output_ids[reasoning_end] is not </think>")
    finish = np.array(table[FINISH_REASON].to_pylist(), dtype=object)
    flag(~np.isin(finish, FINISH_TYPES), f"finish_reason not one of {'|'.join(FINISH_TYPES)}")

    # Tool-call spans: inside the output and starting at a call-begin token.
    spans = table[TOOL_CALL_SPANS].combine_chunks()
    counts = np.diff(spans.offsets.to_numpy())
    owner = np.repeat(np.arange(len(n)), counts)
    flat = spans.flatten()
    starts = flat.field("start").to_numpy().astype(np.int64)
    ends = flat.field("end").to_numpy().astype(np.int64)
    bad = (starts < 0) | (ends <= starts) | (ends > n[owner])
    bad |= ids_at(values, offsets, starts, rows=owner) != tokens.tool_call_begin_id
    flag(np.bincount(owner[bad], minlength=len(n)) > 0, "tool_call_spans out of range or not at a call begin")

    # Stop token: null exactly when the last id is no stop token; else equal to it.
    last = ids_at(values, offsets, n - 1)
    stop = table[STOP_TOKEN]
    stop_valid = stop.is_valid().to_numpy(zero_copy_only=False)
    stop_vals = stop.fill_null(-1).to_numpy()
    is_stop = np.isin(last, tokens.stop_token_ids)
    flag(stop_valid & (stop_vals != last), "stop_token is not the last id")
    flag(~stop_valid & is_stop, "stop_token is null but the last id is a stop token")

    # The spans must be what the ids say (recomputed with the job's marker ids).
    pets = prompts_open_reasoning(in_values, in_offsets, tokens)
    again = compute_spans_batch(values, offsets, pets, tokens)
    for name, stored, fresh in (
        (REASONING_START, rs, again.reasoning_start),
        (REASONING_END, re, again.reasoning_end),
        (HAS_THINK_END, hte, again.has_think_end),
        (ANSWER_START, as_, again.answer_start),
        (ANSWER_END, ae, again.answer_end),
    ):
        flag(checked & (stored != fresh), f"{name} differs from the ids (recomputed {name})")
    # Tool calls: rows with the same number of calls align entry by entry in both flat lists.
    again_counts = np.diff(again.tool_call_offsets)
    same_count = counts == again_counts
    keep = same_count[owner]
    keep_again = same_count[np.repeat(np.arange(len(n)), again_counts)]
    differ = (starts[keep] != again.tool_call_starts[keep_again]) | (ends[keep] != again.tool_call_ends[keep_again])
    flag(~same_count | (np.bincount(owner[keep][differ], minlength=len(n)) > 0), "tool_call_spans differ from the ids")

    expected = pets | reasoning_expected
    stats = ThinkingStats(int(expected.sum()), int((expected & again.has_think_end).sum()))
    pids = table[PROMPT_ID].to_pylist()
    return {pids[i]: problems for i, problems in found.items()}, stats


def hash_mismatches(table: pa.Table, submitted: dict[str, str] | None = None) -> list[str]:
    """Prompt ids of rows whose ``input_ids`` (and, for an image prompt, its ``image_sha256``) do not hash to their
    ``content_hash`` — or, for a row whose hash is no :func:`thinkfleet.message.content_hash` (empty, a
    placeholder), to the hash submitted for the prompt (``submitted``: prompt_id → hash). Placeholders on both
    sides (the test fleet's ``h-<prompt>``) cannot be recomputed; the stale check compares them as text.
    """
    submitted = submitted or {}
    hashes = table[CONTENT_HASH].to_pylist()
    values, offsets = flat_ids(table[INPUT_IDS])
    ids = values.astype("<u4", copy=False)
    images = table[IMAGE_SHA256].to_pylist() if IMAGE_SHA256 in table.column_names else [None] * table.num_rows
    out = []
    for i, (pid, stored) in enumerate(zip(table[PROMPT_ID].to_pylist(), hashes, strict=True)):
        wanted = stored if is_content_hash(stored) else submitted.get(pid)
        if not is_content_hash(wanted):
            continue
        if hash_id_bytes(ids[offsets[i] : offsets[i + 1]].tobytes(), images[i] or ()) != wanted:
            out.append(pid)
    return out


def checksum_mismatches(table: pa.Table) -> list[str]:
    """Prompt ids of rows whose ``ids_crc32`` is not the CRC-32 of their ids (rows without one — written before
    schema 6 — are not checked)."""
    if IDS_CRC32 not in table.column_names or table.num_rows == 0:
        return []
    stored = table[IDS_CRC32]
    valid = stored.is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return []
    differ = valid & (stored.fill_null(0).to_numpy() != table_ids_checksums(table))
    pids = table[PROMPT_ID].to_pylist()
    return [pids[i] for i in differ.nonzero()[0].tolist()]


def image_problems(table: pa.Table, placeholder_id: int | None = None) -> dict[str, list[str]]:
    """``{prompt_id: [problem, …]}`` for image prompts whose ids are not what the producer rendered for them: the
    four image columns one entry per image; each ``image_positions`` entry inside ``input_ids``, in order, holding the
    placeholder (``placeholder_id``, the job record's; else the id at the row's first position); and that id nowhere
    else — one placeholder per image, never expanded (SGLang would expand a second copy again). The ids themselves
    are bound to what was submitted by the content hash (:func:`hash_mismatches`, which covers the images' sha256s)."""
    if IMAGE_SHA256 not in table.column_names or table[IMAGE_SHA256].null_count == table.num_rows:
        return {}
    values, offsets = flat_ids(table[INPUT_IDS])
    found: dict[str, list[str]] = {}
    columns = [table[c].to_pylist() for c in (PROMPT_ID, IMAGE_SHA256, IMAGE_PATHS, IMAGE_TOKENS, IMAGE_POSITIONS)]
    # schema 11: the prompt ids a server >= 0.5.13 returned (null where it returned none, and in older parts)
    expanded = table[EXPANDED_INPUT_IDS].to_pylist() if EXPANDED_INPUT_IDS in table.column_names else None
    for i, (pid, shas, paths, tokens, positions) in enumerate(zip(*columns, strict=True)):
        if shas is None and paths is None and tokens is None and positions is None:
            continue  # a text prompt
        ids = values[offsets[i] : offsets[i + 1]]
        problems = _image_row(ids, shas, paths, tokens, positions, placeholder_id)
        if not problems and expanded is not None and expanded[i] is not None:
            problems = _expanded_problems(ids, tokens, positions, expanded[i])
        if problems:
            found[pid] = problems
    return found


def _expanded_problems(ids: np.ndarray, tokens: list[int], positions: list[int], served: list[int]) -> list[str]:
    """The server's expanded prompt must be ``ids`` with each image's one placeholder repeated ``image_tokens`` times
    (what the worker checked before storing it: thinkfleet/vision.py ``expand_ids``)."""
    reps = np.ones(len(ids), dtype=np.int64)
    reps[np.asarray(positions, dtype=np.int64)] = tokens
    want = np.repeat(ids, reps)
    got = np.asarray(served, dtype=want.dtype)
    if len(got) == len(want) and bool((got == want).all()):
        return []
    if len(got) != len(want):
        return [f"expanded_input_ids hold {len(got)} ids, the ids with each placeholder expanded {len(want)}"]
    first = int(np.flatnonzero(got != want)[0])
    return [f"expanded_input_ids differ from the ids with each placeholder expanded at position {first}"]


def _image_row(
    ids: np.ndarray,
    shas: list[str] | None,
    paths: list[str] | None,
    tokens: list[int] | None,
    positions: list[int] | None,
    placeholder_id: int | None,
) -> list[str]:
    counts = [len(c) if c is not None else 0 for c in (shas, paths, tokens, positions)]
    if len(set(counts)) != 1 or not counts[0]:
        return [
            f"image columns disagree: {counts[0]} image_sha256, {counts[1]} image_paths, {counts[2]} image_tokens, "
            f"{counts[3]} image_positions (one entry per image in each)"
        ]
    assert tokens is not None and positions is not None
    problems = []
    if min(tokens) < 1:
        problems.append(f"image_tokens {tokens} has a count under 1")
    pos = np.asarray(positions, dtype=np.int64)
    if (pos < 0).any() or (pos >= len(ids)).any() or (np.diff(pos) <= 0).any():
        where = f"are not increasing positions inside input_ids ({len(ids)} ids)"
        return [*problems, f"image_positions {positions} {where}"]
    wanted = placeholder_id if placeholder_id is not None else int(ids[pos[0]])
    wrong = [p for p in positions if int(ids[p]) != wanted]
    if wrong:
        problems.append(f"input_ids hold no placeholder (id {wanted}) at image_positions {wrong}")
    placed = int(np.count_nonzero(ids == wanted))
    if placed != len(positions):
        problems.append(
            f"input_ids hold {placed} placeholders (id {wanted}) for {len(positions)} images: one per image, never "
            "expanded"
        )
    return problems
