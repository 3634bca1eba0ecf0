"""A validated generation → one Parquet row (column names from storage.schema)."""

from __future__ import annotations

import functools
import json
import socket
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

from storage.quality import raised, row_flags
from storage.schema import (
    EXPANDED_INPUT_IDS,
    IMAGE_PATHS,
    IMAGE_POSITIONS,
    IMAGE_SHA256,
    IMAGE_TOKENS,
    span_values,
)
from storage.spans import compute_spans, prompt_opens_reasoning
from thinkfleet.message import PromptTask
from thinkfleet.state.ledger import FinalRow
from thinkfleet.tokens import SpanTokens
from workers.jobs import JobSpec
from workers.sglang import Generation, ServerInfo

_HOST = socket.gethostname()


@functools.cache
def _span_keywords(tokens: SpanTokens) -> dict[str, Any]:
    """``compute_spans``' keywords for a job's tokens (``asdict`` deep-copies: once per job, not per row)."""
    return asdict(tokens)


@dataclass(frozen=True)
class JobFinalRow(FinalRow):
    """A :class:`FinalRow` that also says whether its job watches for the reasoning alarm: a job run with
    ``--no-reasoning-spans`` has no ``</think>`` to miss (the committer never raises the alarm for it)."""

    reasoning_alarm: bool = True


def build_row(
    task: PromptTask,
    job: JobSpec,
    input_ids: list[int],
    gen: Generation,
    sampling_params: dict[str, Any],
    worker: str,
    model: str,
    attempt: int,
    latency_s: float,
    deterministic: bool | None = None,
    epoch: int = 0,
    server: ServerInfo | None = None,
) -> tuple[dict[str, Any], FinalRow]:
    """One row; counts the server did not report (``reasoning_tokens`` before SGLang 0.5.10, …) stay None
    (null), and ``deterministic`` says whether the server honoured ``sampling_seed`` (None: unknown). ``epoch`` is
    the claim's fencing token (thinkfleet/state/ledger.py), stored with the row. ``server``: what the gate knew
    of the server that answered — the row names its launch record (``server_config``; when None, the provenance
    hook fills it in before the write: workers/provenance.py)."""
    opens = prompt_opens_reasoning(input_ids, job.tokens)
    spans = compute_spans(
        gen.output_ids,
        prompt_ends_with_think_start=opens,
        **_span_keywords(job.tokens),
    )
    seed = sampling_params.get("sampling_seed")
    flags = row_flags(gen.output_ids, spans, opens, job.tokens)  # storage/quality.py: stored, and counted live
    row = {
        "job": task.job,
        "dataset": task.dataset,
        "prompt_id": task.prompt_id,
        "row_index": task.row_index,
        "sample_index": task.sample_index,
        "revision": task.revision,
        "attempt": attempt,
        "epoch": epoch or None,
        "input_ids": input_ids,
        "output_ids": gen.output_ids,
        # --logprobs K: aligned with output_ids (parse_response checked it); null when not requested
        "output_logprobs": gen.output_logprobs,
        "top_logprob_ids": gen.top_logprob_ids,
        "top_logprobs": gen.top_logprobs,
        **span_values(spans, job.tokens),  # null reasoning/answer spans under --no-reasoning-spans
        "finish_reason": gen.finish_type,
        "finish_matched": gen.finish_matched,
        "prompt_tokens": gen.prompt_tokens or len(input_ids),
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "prefix_reusable_tokens": task.prefix_reusable,  # a later turn's: what its previous turn's server computed
        "reasoning_tokens": gen.reasoning_tokens,
        "num_retractions": gen.num_retractions,
        "latency_s": latency_s,
        "worker": worker,
        "worker_host": _HOST,
        "model": model,
        "weight_version": gen.weight_version,
        "sampling_params": json.dumps(sampling_params, sort_keys=True),
        "sampling_seed": None if seed is None else int(seed),
        "deterministic": deterministic,
        "tokenizer_fingerprint": job.tokenizer_fingerprint,
        "chat_template_hash": job.chat_template_hash,
        "server_config": server.config_digest if server is not None else None,
        "content_hash": task.content_hash,
        # --turns all: filled before the write by the TurnChaining hook (workers/turns.py); null for single-turn jobs
        "conversation_id": None,
        "turn_index": None,
        "turn_count": None,
        # agentic steps and chain ends (workers/turns.py, tool_steps.py fill them); present in every row, so
        # rows_to_table's one-itemgetter-per-row path applies (a missing key sends it down the per-column one)
        "step_index": None,
        "tool_args_differ": None,
        "chain_end": None,
        "created_at": datetime.now(UTC),
        # --speculative-algorithm on the server: its acceptance figures of this row (null otherwise)
        "spec_verify_ct": gen.spec_verify_ct,
        "spec_accepted_tokens": gen.spec_accepted_tokens,
        "spec_draft_tokens": gen.spec_draft_tokens,
        "spec_accept_histogram": gen.spec_accept_histogram,
        # an image prompt's images, one per placeholder (docs/vision.md); null for a text prompt
        **image_columns(task),
        # the prompt as the server expanded it (SGLang >= 0.5.13, checked against the ids sent); null otherwise
        EXPANDED_INPUT_IDS: gen.prompt_token_ids,
        **flags,
    }
    truncated = gen.finish_type == "length"
    final = final_row(task, job, gen.completion_tokens, spans.has_think_end, truncated, opens, epoch)
    final = replace(final, flags=raised(flags, gen.finish_type != "stop"))
    if task.prefix_reusable is not None:  # the job's prefix-cache counters (finalize.lua)
        final = replace(final, prefix_reusable=task.prefix_reusable, cached_tokens=gen.cached_tokens)
    return row, final


def image_columns(task: PromptTask) -> dict[str, Any]:
    """The row's image columns from the message's references (all null for a text prompt)."""
    media = task.media
    if not media:
        return {IMAGE_SHA256: None, IMAGE_PATHS: None, IMAGE_TOKENS: None, IMAGE_POSITIONS: None}
    return {
        IMAGE_SHA256: [m.sha256 for m in media],
        IMAGE_PATHS: [m.uri for m in media],
        IMAGE_TOKENS: [m.tokens for m in media],
        IMAGE_POSITIONS: [m.position for m in media],
    }


def final_row(
    task: PromptTask,
    job: JobSpec,
    completion_tokens: int,
    has_think_end: bool,
    truncated: bool,
    prompt_opens: bool,
    epoch: int = 0,
    revision: int | None = None,
) -> JobFinalRow:
    """What ``finalize`` records of a row — the same for a row just generated and for an orphan's stored row:
    whether its job watches the alarm, and whether this row is expected to reason. ``revision``: the stored row's
    (an orphan's); None: the message's."""
    return JobFinalRow(
        prompt_id=task.prompt_id,
        completion_tokens=completion_tokens,
        has_think_end=has_think_end,
        truncated=truncated,
        reasoning_alarm=job.tokens.reasoning_spans,
        expects_reasoning=prompt_opens or job.expects_reasoning,
        epoch=epoch,
        revision=task.revision if revision is None else revision,
    )
