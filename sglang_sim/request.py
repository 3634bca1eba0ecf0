"""A ``/generate`` request, from its bytes to validated prompts: body parsing, call normalization, per-item checks.

The steps SGLang takes before a request reaches the scheduler, in its order and wording (checked against the
0.5.9 and 0.5.23 wheels: ``entrypoints/http_server.py``, ``managers/io_struct.py``,
``managers/tokenizer_manager.py``): FastAPI's typed body (:func:`parse_body`), ``GenerateReqInput.
normalize_batch_and_arguments`` into one :class:`GenerateItem` per prompt (:func:`normalize_call`), then the
tokenizer manager's per-request checks and the sampling params (:func:`validate_item`, which uses
:mod:`sglang_sim.sampling`). Refusals are :mod:`sglang_sim.errors`' exceptions.

Where the simulator cannot imitate a feature (input_embeds) it refuses with a 400 that says so instead of
returning something plausible but fake. Logprobs (``return_logprob``, ``top_logprobs_num``) are synthetic but
exact in shape (``content.expected_logprobs``); ``logprob_start_len`` is taken as -1.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from sglang_sim.content import DEFAULT_MAX_NEW_TOKENS
from sglang_sim.errors import BadRequest, InvalidBody
from sglang_sim.sampling import SamplingParams, parse_sampling_params


# -- request body ------------------------------------------------------------------------------------
class _GenerateBody(BaseModel):
    """The typed part of ``GenerateReqInput`` (unknown fields are ignored, as FastAPI does)."""

    model_config = ConfigDict(extra="ignore")

    text: list[str] | str | None = None
    input_ids: list[list[int]] | list[int] | None = None
    input_embeds: list[Any] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    rid: list[str] | str | None = None
    return_logprob: list[bool] | bool | None = None
    top_logprobs_num: list[int] | int | None = None
    logprob_start_len: list[int] | int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_prompt_token_ids: bool = False
    require_reasoning: bool = False
    #: One image (or a list) per placeholder, per prompt of a batch (sglang_sim/vision.py).
    image_data: list[Any] | str | None = None
    return_hidden_states: list[bool] | bool = False


_INPUT_IDS = TypeAdapter(list[list[int]] | list[int] | None)


def parse_body(raw: bytes) -> _GenerateBody:
    """JSON bytes → typed body; raises :class:`InvalidBody` like FastAPI would."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        detail = getattr(exc, "msg", str(exc))
        raise InvalidBody(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": detail},
                }
            ]
        ) from None
    # input_ids is the bulk of a body: a plain list of ints skips pydantic (which checks every element).
    input_ids = data.pop("input_ids", None) if isinstance(data, dict) else None
    errors: list[dict[str, Any]] = []
    if not _is_id_list(input_ids):
        try:
            input_ids = _INPUT_IDS.validate_python(input_ids)
        except ValidationError as exc:
            errors += _errors(exc, ("body", "input_ids"))
    try:
        body = _GenerateBody.model_validate(data)
    except ValidationError as exc:
        errors += _errors(exc, ("body",))
    if errors:
        raise InvalidBody(errors)
    body.input_ids = input_ids
    return body


def _is_id_list(value: Any) -> bool:
    if type(value) is not list:
        return False
    if all(type(t) is int for t in value):
        return True
    return all(type(row) is list and all(type(t) is int for t in row) for row in value)


def _errors(exc: ValidationError, prefix: tuple[Any, ...]) -> list[dict[str, Any]]:
    errors = []
    for err in exc.errors(include_url=False):
        entry = {"type": err["type"], "loc": (*prefix, *err["loc"]), "msg": err["msg"], "input": err["input"]}
        if "ctx" in err:
            entry["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        errors.append(entry)
    return errors


# -- normalized call ---------------------------------------------------------------------------------
@dataclass
class GenerateItem:
    """One prompt of a call (a batch has several)."""

    index: int
    rid: str
    input_ids: list[int]
    raw_sampling_params: dict[str, Any]
    params: SamplingParams | None = None  # set by validate_item
    #: max_new_tokens after SGLang's defaults (None → what the context leaves).
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    #: ``return_logprob`` / ``top_logprobs_num`` of this item (``normalize_batch_and_arguments``).
    return_logprob: bool = False
    top_logprobs_num: int = 0
    #: This item's images, one per placeholder in order (empty: a text prompt).
    image_data: list[Any] = field(default_factory=list)


@dataclass
class GenerateCall:
    items: list[GenerateItem]
    is_single: bool
    stream: bool
    return_prompt_token_ids: bool
    require_reasoning: bool
    #: True when the client chose the rids (fault choice keys on them then).
    client_rids: bool = field(default=False)
    #: ``return_text_in_logprobs`` (the third element of each logprob triple; null without a tokenizer).
    return_text_in_logprobs: bool = False


@dataclass(frozen=True)
class Limits:
    context_length: int
    vocab_size: int
    max_req_input_len: int
    #: ``input + max_new_tokens >= context_length`` is refused (≤ 0.5.10); False: only ``>`` (0.5.11+).
    context_check_inclusive: bool = False
    #: Unknown sampling keys and non-numeric numbers are a TypeError → 500 (before the 0.5.22 contract).
    type_error_500: bool = False


def normalize_call(
    body: _GenerateBody, encode: Callable[[str], list[int]], reject_duplicate_rids: bool = True
) -> GenerateCall:
    """``GenerateReqInput.normalize_batch_and_arguments`` (plus tokenizing ``text``).

    ``reject_duplicate_rids`` (0.5.11+): a rid repeated inside the batch is a 400; 0.5.9 accepts it.
    """
    if body.text is None and body.input_ids is None and body.input_embeds is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if body.return_hidden_states is True or (
        isinstance(body.return_hidden_states, list) and any(body.return_hidden_states)
    ):
        raise BadRequest(
            "The server is not configured to return the hidden states. "
            "Please set `--enable-return-hidden-states` to enable this feature."
        )
    prompts = _prompts(body, encode)
    is_single = not (isinstance(body.text, list) or (body.text is None and isinstance(body.input_ids[0], list)))  # type: ignore[index]
    n = len(prompts)
    params = _per_item_sampling_params(body.sampling_params, is_single, n)
    rids = _rids(body.rid, is_single, n)
    if reject_duplicate_rids and len(set(rids)) != len(rids):
        counts = Counter(rids)
        duplicates = [rid for rid, count in counts.items() if count > 1]
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
    items = [GenerateItem(i, rids[i], prompts[i], params[i]) for i in range(n)]
    for i, item in enumerate(items):
        item.return_logprob = bool(_per_item(body.return_logprob, i, False))
        item.top_logprobs_num = int(_per_item(body.top_logprobs_num, i, 0) or 0)
        item.image_data = _item_images(body.image_data, is_single, i)
    return GenerateCall(
        items=items,
        is_single=is_single,
        stream=body.stream,
        return_prompt_token_ids=body.return_prompt_token_ids,
        require_reasoning=body.require_reasoning,
        client_rids=body.rid is not None,
        return_text_in_logprobs=body.return_text_in_logprobs,
    )


def _per_item(value: Any, index: int, default: Any) -> Any:
    """A batch argument given once or per item (None → ``default``), as ``normalize_param`` spreads it."""
    if isinstance(value, list):
        return value[index] if index < len(value) else default
    return default if value is None else value


def _item_images(value: Any, is_single: bool, index: int) -> list[Any]:
    """One item's images: a single request's ``image_data`` (one image or a list); a batch's, per item."""
    if value is None:
        return []
    if is_single:
        return list(value) if isinstance(value, list) else [value]
    entry = value[index] if isinstance(value, list) and index < len(value) else None
    return [] if entry is None else list(entry) if isinstance(entry, list) else [entry]


def _prompts(body: _GenerateBody, encode: Callable[[str], list[int]]) -> list[list[int]]:
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return [encode(text) for text in texts]
    if body.input_ids is None:
        raise BadRequest("sglang-sim does not simulate input_embeds; send input_ids.")
    if len(body.input_ids) == 0:
        raise BadRequest("input_ids cannot be empty.")
    if isinstance(body.input_ids[0], list):
        return [list(ids) for ids in body.input_ids]  # type: ignore[arg-type]
    return [list(body.input_ids)]  # type: ignore[arg-type]


def _per_item_sampling_params(raw: Any, is_single: bool, n: int) -> list[dict[str, Any]]:
    if raw is None:
        return [{} for _ in range(n)]
    if isinstance(raw, dict):
        return [raw] * n
    if is_single:
        raise BadRequest("sampling_params should be a dict for a single request.")
    if len(raw) != n:
        raise BadRequest("The length of sampling_params should be equal to the batch size.")
    return list(raw)


def _rids(raw: Any, is_single: bool, n: int) -> list[str]:
    if is_single:
        if raw is None:
            return [uuid.uuid4().hex]
        if not isinstance(raw, str):
            raise BadRequest("The rid should be a string for a single request.")
        return [raw]
    if raw is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(raw, str):
        return [f"{raw}_{i}" for i in range(n)]
    if len(raw) != n:
        raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
    return list(raw)


def validate_item(item: GenerateItem, limits: Limits, has_tokenizer: bool) -> None:
    """The tokenizer manager's per-request checks, in its order; fills ``params``/``max_new_tokens``."""
    ids = item.input_ids
    if ids and max(ids) >= limits.vocab_size:
        raise BadRequest(f"The input_ids {ids} contains values greater than the vocab size ({limits.vocab_size}).")
    if ids and min(ids) < 0:
        raise BadRequest(f"The input_ids {ids} contains negative values; token ids are in [0, {limits.vocab_size}).")
    n = len(ids)
    if n >= limits.context_length:
        raise BadRequest(
            f"The input ({n} tokens) is longer than the model's context length ({limits.context_length} tokens)."
        )
    max_new = item.raw_sampling_params.get("max_new_tokens")
    total = max_new + n if isinstance(max_new, int) and not isinstance(max_new, bool) else None
    too_long = total is not None and (
        total >= limits.context_length if limits.context_check_inclusive else total > limits.context_length
    )
    if too_long and isinstance(max_new, int):
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} "
            f"tokens. You requested a total of {max_new + n} tokens: {n} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit."
        )
    # The tokenizer manager builds SamplingParams next; the scheduler checks max_req_input_len after it.
    item.params = parse_sampling_params(
        item.raw_sampling_params, limits.vocab_size, has_tokenizer, limits.type_error_500
    )
    if n >= limits.max_req_input_len:
        raise BadRequest(
            f"Input length ({n} tokens) exceeds the maximum allowed length ({limits.max_req_input_len} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    # The scheduler turns max_new_tokens=None into "whatever the context leaves".
    item.max_new_tokens = (
        limits.context_length - n - 1 if item.params.max_new_tokens is None else item.params.max_new_tokens
    )
