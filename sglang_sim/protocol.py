"""SGLang's native ``/generate`` wire format as the simulator speaks it.

Request parsing and validation, response and error bodies, SSE framing — with SGLang's own wording
(checked against the 0.5.9 and 0.5.23 wheels: ``entrypoints/http_server.py``, ``managers/tokenizer_manager.py``,
``managers/io_struct.py`` and ``sampling/sampling_params.py``).

Error paths, as in SGLang (which of them applies depends on the release, :mod:`sglang_sim.versions`):

- :class:`InvalidBody` — the body is not JSON or has wrong types (FastAPI's ``RequestValidationError``,
  turned into 400): ``{"object":"error","message":…,"type":"Bad Request","param":null,"code":400}``.
- :func:`contract_error` (0.5.22+) — a sampling key the api/v1 schema does not know, or a value of the
  wrong JSON type: 400 ``{"error": "<serde message>"}`` (a *string*), streamed or not.
- :class:`BadRequest` — a ``ValueError`` raised while validating (empty input, too long, bad sampling
  params, duplicate rid): 400 ``{"error":{"message":…}}``; for ``stream: true`` SGLang has already
  started the SSE response, so it is one ``data: {"error":…}`` chunk and ``data: [DONE]`` with 200.
- :class:`InternalError` (before 0.5.22) — ``SamplingParams(**sampling_params)`` raises TypeError on an
  unknown key (and comparisons do on a non-numeric number): FastAPI answers 500 ``Internal Server
  Error`` as text/plain; a stream has already sent its 200 headers and the connection just closes.

Where the simulator cannot imitate a feature (input_embeds, n > 1) it refuses with a 400 that says so
instead of returning something plausible but fake. Logprobs (``return_logprob``, ``top_logprobs_num``)
are synthetic but exact in shape (``content.expected_logprobs``); ``logprob_start_len`` is taken as -1.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from sglang_sim.content import DEFAULT_MAX_NEW_TOKENS

QUEUE_FULL_MESSAGE = "The request queue is full."
SSE_DONE = b"data: [DONE]\n\n"
_SAMPLING_EPS = 1e-6
_TOP_K_ALL = 1 << 30


class InvalidBody(Exception):
    """FastAPI-style validation failure → 400 with SGLang's ErrorResponse shape."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        n = len(errors)
        head = f"{n} validation error{'s' if n != 1 else ''}:\n" + "".join(f"  {e}\n" for e in errors)
        super().__init__(f"{head} {errors}")
        self.errors = errors

    @property
    def body(self) -> dict[str, Any]:
        return error_response_body(str(self), 400, "Bad Request")


class BadRequest(ValueError):
    """A ``ValueError`` SGLang raises while validating a request → 400 ``{"error":{"message"}}``."""


class InternalError(Exception):
    """An exception SGLang does not catch (a TypeError) → FastAPI's 500 ``Internal Server Error``."""


#: Starlette's body for an unhandled exception (text/plain).
INTERNAL_ERROR_TEXT = "Internal Server Error"


def error_body(message: str) -> dict[str, Any]:
    """``_create_error_response``: the body of a 400 from a ValueError."""
    return {"error": {"message": message}}


def error_response_body(message: str, status: int, type_: str | None = None) -> dict[str, Any]:
    """``ErrorResponse`` (HTTPException handler): used for 503s and body validation errors."""
    return {"object": "error", "message": message, "type": type_ or str(status), "param": None, "code": status}


def stream_error_chunk(message: str, detailed: bool = True) -> dict[str, Any]:
    """The chunk SGLang emits when a streamed request fails validation, before ``[DONE]``.

    ``detailed`` (0.5.21+) adds ``type``/``code``/``retryable``; 0.5.9 sends ``{"error": {"message"}}``.
    """
    if not detailed:
        return {"error": {"message": message}}
    return {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    """One SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(obj) + b"\n\n"


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


# -- the api/v1 JSON contract (0.5.22+: entrypoints/api_contract.py, api/v1/api_types.py) ----------------
#: ``_FIELDS_SamplingParams`` of sglang 0.5.23, in its order (serde lists them in unknown-field errors).
CONTRACT_SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
#: The JSON type ``decode_SamplingParams`` expects of each scalar field (serde's wording).
_CONTRACT_EXPECTED = {
    **dict.fromkeys(("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval"), "i64"),
    **dict.fromkeys(("sampling_seed", "beam_width"), "i64"),
    **dict.fromkeys(
        ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"), "f64"
    ),
    **dict.fromkeys(
        ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"), "a boolean"
    ),
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), "a string"),
}


def _serde_unexpected(value: Any) -> str:
    """serde's ``Unexpected`` display (``_unexpected`` in api_types.py)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _contract_type_ok(value: Any, expected: str) -> bool:
    if expected == "i64":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "f64":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected == "a boolean":
        return isinstance(value, bool)
    return isinstance(value, str)


def contract_error(sampling_params: Any) -> str | None:
    """The 400 text SGLang 0.5.22+ returns for ``sampling_params`` (``{"error": <this>}``), or None.

    Covers what ``decode_SamplingParams`` checks for the scalar fields — an unknown key, and a value of
    the wrong JSON type (null is always accepted); the list/map fields are not type-checked here.
    """
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for params in items:
        if not isinstance(params, dict):
            continue  # FastAPI's model validation has already refused it
        for key, value in params.items():
            if key not in CONTRACT_SAMPLING_FIELDS:
                listed = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
                return f"unknown field `{key}`, expected one of {listed}"
            expected = _CONTRACT_EXPECTED.get(key)
            if value is not None and expected is not None and not _contract_type_ok(value, expected):
                return f"invalid type: {_serde_unexpected(value)}, expected {expected}"
    return None


# -- sampling params -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """``SamplingParams`` after ``__post_init__``/``normalize``/``verify`` (the fields the sim uses)."""

    max_new_tokens: int | None
    stop_token_ids: frozenset[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    sampling_seed: int | None


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_OTHER_FIELDS = (
    "stop",
    "stop_token_ids",
    "stop_regex",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "logit_bias",
)
_KNOWN_FIELDS = frozenset(_FLOAT_FIELDS + _INT_FIELDS + _BOOL_FIELDS + _OTHER_FIELDS)
_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "no_stop_trim": False,
}


def parse_sampling_params(
    raw: dict[str, Any], vocab_size: int, has_tokenizer: bool, type_error_500: bool = False
) -> SamplingParams:
    """Validate one item's ``sampling_params`` with SGLang's rules and messages.

    ``type_error_500`` (releases before the api/v1 contract, e.g. 0.5.9): an unknown key or a
    non-numeric number is SGLang's uncaught TypeError, :class:`InternalError`.
    """
    for key in raw:
        if key not in _KNOWN_FIELDS:
            if type_error_500:
                raise InternalError(f"SamplingParams.__init__() got an unexpected keyword argument '{key}'")
            if key in CONTRACT_SAMPLING_FIELDS:
                raise BadRequest(f"sglang-sim does not simulate sampling_params.{key}; leave it out.")
            raise BadRequest(f"Unexpected keyword argument '{key}'")
    p = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    p.setdefault("max_new_tokens", None if "max_new_tokens" in raw else DEFAULT_MAX_NEW_TOKENS)
    _check_types(p, type_error_500)
    if 0 <= p["temperature"] < _SAMPLING_EPS:  # greedy: SGLang rewrites it as top_k = 1
        p["temperature"], p["top_k"] = 1.0, 1
    if p["top_k"] == -1:
        p["top_k"] = _TOP_K_ALL
    _verify(p, vocab_size)
    _require_tokenizer(p, has_tokenizer)
    if p["n"] != 1:
        raise BadRequest("sglang-sim does not simulate parallel sampling (n > 1); send n requests instead.")
    stop_ids = p.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be a list of token ids, got {stop_ids!r}.")
    return SamplingParams(
        max_new_tokens=p["max_new_tokens"],
        stop_token_ids=frozenset(stop_ids),
        temperature=float(p["temperature"]),
        top_p=float(p["top_p"]),
        top_k=int(p["top_k"]),
        min_p=float(p["min_p"]),
        ignore_eos=bool(p["ignore_eos"]),
        skip_special_tokens=bool(p["skip_special_tokens"]),
        no_stop_trim=bool(p["no_stop_trim"]),
        sampling_seed=p.get("sampling_seed"),
    )


def _check_types(p: dict[str, Any], type_error_500: bool = False) -> None:
    """Wrong value types. With ``type_error_500`` a non-number in a numeric field is SGLang's TypeError
    (500); otherwise — and for the cases Python would not even notice (a bool for a number, a float for
    an integer, a non-bool flag) — the simulator refuses with a 400 that says what is wrong."""
    for name in _FLOAT_FIELDS + _INT_FIELDS:
        value = p.get(name)
        if type_error_500 and value is not None and not isinstance(value, int | float):
            raise InternalError(f"'<' not supported between instances of {type(value).__name__!r} and 'float'")
    for name in _FLOAT_FIELDS:
        value = p.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise BadRequest(f"sampling_params.{name} must be a number, got {value!r}.")
    for name in _INT_FIELDS:
        value = p.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"sampling_params.{name} must be an integer, got {value!r}.")
    for name in _BOOL_FIELDS:
        value = p.get(name)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"sampling_params.{name} must be a boolean, got {value!r}.")


def _verify(p: dict[str, Any], vocab_size: int) -> None:
    """``SamplingParams.verify``, same order and wording."""
    if not math.isfinite(p["temperature"]) or p["temperature"] < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {p['temperature']}.")
    if not 0.0 < p["top_p"] <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p['top_p']}.")
    if not 0.0 <= p["min_p"] <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {p['min_p']}.")
    if p["top_k"] < 1 or p["top_k"] == -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
    if not -2.0 <= p["frequency_penalty"] <= 2.0:
        raise BadRequest(f"frequency_penalty must be in [-2, 2], got {p['frequency_penalty']}.")
    if not -2.0 <= p["presence_penalty"] <= 2.0:
        raise BadRequest(f"presence_penalty must be in [-2, 2], got {p['presence_penalty']}.")
    if not 0.0 < p["repetition_penalty"] <= 2.0:
        raise BadRequest(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p['repetition_penalty']}.")
    if p["min_new_tokens"] < 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {p['min_new_tokens']}.")
    max_new = p["max_new_tokens"]
    if max_new is not None:
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
        if not p["min_new_tokens"] <= max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {p['min_new_tokens']}.")
    for token_id in p.get("logit_bias") or {}:
        if not 0 <= int(token_id) < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if sum(p.get(k) is not None for k in ("json_schema", "regex", "ebnf")) > 1:
        raise BadRequest("Only one of regex, json_schema, or ebnf can be set.")


def _require_tokenizer(p: dict[str, Any], has_tokenizer: bool) -> None:
    """``raise_if_tokenizer_required``: string stops and min_new_tokens need a tokenizer."""
    if has_tokenizer:
        return
    if p.get("stop"):
        raise BadRequest(
            f"stop={p['stop']!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    if p.get("stop_regex"):
        raise BadRequest(
            f"stop_regex={p['stop_regex']!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    if p["min_new_tokens"] > 0:
        raise BadRequest(
            f"min_new_tokens={p['min_new_tokens']} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer for eos_token_id)."
        )


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


# -- response ----------------------------------------------------------------------------------------
def meta_info(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    weight_version: str,
    reasoning_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency_s: float | None = None,
    sent_ts: float | None = None,
    retractions_key: str = "num_retractions",
    with_reasoning_tokens: bool = True,
    with_cached_tokens_details: bool = False,
    timing: bool = False,
    in_batch: bool = False,
    layout: str = "0.5.9",
) -> dict[str, Any]:
    """``meta_info`` in ``_handle_batch_output``'s key order; ``e2e_latency`` only once finished.

    0.5.9: ``total_retractions`` and no ``reasoning_tokens``; 0.5.12+: ``num_retractions``; 0.5.10+:
    ``reasoning_tokens`` (see :class:`sglang_sim.versions.VersionProfile`). ``cached_tokens_details`` is
    null (no hierarchical cache). ``timing`` (0.5.9 with ``--enable-metrics``, as compose runs it): the
    scheduler's ``queue_time``, ``prefill_launch_delay``, ``prefill_launch_latency``, ``prefill_finished_ts``
    in every chunk, and ``_calculate_timing_metrics``' timestamps once finished (measured against a real
    0.5.9: tests/real_sglang). ``decode_throughput`` is left out: the real server adds it only when a token
    reached the tokenizer manager before the last one, which depends on its batching. A request of a batch
    (``input_ids`` a list of lists) has no ``request_sent_to_scheduler_ts``. ``layout="0.5.23"``: that
    release's keys (:func:`_meta_info_0_5_23`).
    """
    if layout == "0.5.23":
        return _meta_info_0_5_23(
            rid=rid, finish_reason=finish_reason, prompt_tokens=prompt_tokens, weight_version=weight_version,
            reasoning_tokens=reasoning_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
            e2e_latency_s=e2e_latency_s, sent_ts=sent_ts, retractions_key=retractions_key, timing=timing,
        )  # fmt: skip
    now = time.time()
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        retractions_key: 0,
    }
    if with_reasoning_tokens:
        meta["reasoning_tokens"] = reasoning_tokens
    if timing:
        meta |= {"queue_time": 0.0, "prefill_launch_delay": 0.0, "prefill_launch_latency": 0.0}
        meta["prefill_finished_ts"] = now - (e2e_latency_s or 0.0)
    meta["completion_tokens"] = completion_tokens
    meta["cached_tokens"] = cached_tokens
    if with_cached_tokens_details:
        meta["cached_tokens_details"] = None
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
        if timing:
            received = (sent_ts or now) - e2e_latency_s
            meta["request_received_ts"] = received
            if not in_batch:
                meta["request_sent_to_scheduler_ts"] = received
            meta |= {"decode_finished_ts": sent_ts or now, "inference_time": e2e_latency_s}
        meta["response_sent_to_client_ts"] = sent_ts
    return meta


def _meta_info_0_5_23(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    weight_version: str,
    reasoning_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency_s: float | None,
    sent_ts: float | None,
    retractions_key: str,
    timing: bool,
) -> dict[str, Any]:
    """0.5.23's ``meta_info`` (``TokenizerManager._handle_batch_output``, measured against a real 0.5.23:
    tests/real_sglang). With ``--enable-metrics`` (``timing``) the scheduler's ``SchedulerReqTimeStats.
    convert_to_output_meta_info`` keys after the retraction count in every chunk, and once finished the tokenizer
    manager's ``ReqTimeStats.convert_to_output_meta_info`` keys (``decode_throughput`` left out, as for 0.5.9).
    ``weight_versions`` (one span: no weight update mid-request) only once finished (``compute_weight_version_spans``);
    ``cached_tokens_details`` ``{"device", "host"}`` once a prefix was cached, else null
    (``OutputStreamer.get_cached_tokens_details``); ``dp_rank`` null (no DP attention)."""
    now = time.time()
    final = e2e_latency_s is not None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        retractions_key: 0,
    }
    received = (sent_ts or now) - (e2e_latency_s or 0.0)
    if timing:
        meta |= {"storage_prefetch_wait": 0.0, "storage_staging_wait": 0.0}
        meta |= {"forward_entry_time": received, "prefill_finished_time": received, "queue_time": 0.0}
    meta["reasoning_tokens"] = reasoning_tokens
    meta |= {"completion_tokens": completion_tokens, "cached_tokens": cached_tokens}
    if final:
        meta["weight_versions"] = [{"version": weight_version, "start": 0, "end": completion_tokens}]
    meta["cached_tokens_details"] = {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None
    meta["dp_rank"] = None
    if final:
        meta["e2e_latency"] = e2e_latency_s
        if timing:
            meta |= {"request_received_ts": received, "first_token_latency": 0.0}
            meta |= {"api_server_dispatch_finish_ts": received, "request_finished_ts": sent_ts or now}
        meta["response_sent_to_client_ts"] = sent_ts
    return meta


#: CUDA-graph capture phases ``startup_time`` and ``memory_usage.graph`` report per phase in 0.5.23.
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


def startup_time_0_5_23(total_s: float, tokenizer: bool) -> dict[str, Any]:
    """0.5.23's ``startup_time`` (``/server_info``: with ``tokenizer_e2e``; ``internal_states[i]``: without):
    seconds per start-up phase, measured against a real 0.5.23. The simulator has no phases: ``total_s`` is
    split as a GPU host might (weights most of it)."""
    out: dict[str, Any] = {
        "load_weight": 0.7 * total_s,
        "kv_cache_allocation": 0.05 * total_s,
        "scheduler_e2e": 0.9 * total_s,
        "cuda_graph": dict.fromkeys(GRAPH_PHASES, 0.0) | {"decode": 0.1 * total_s},
    }
    if tokenizer:
        out["tokenizer_e2e"] = total_s
    return out


def launch_command() -> str:
    """0.5.23's ``/server_info.launch_command``: the server's command-line arguments, one string."""
    return " ".join(sys.argv[1:])


def embedding_plan_0_5_23() -> dict[str, Any]:
    """0.5.23's ``/model_info.embedding`` for a generation model: ``configs/embedding_model_spec.py``
    ``resolved_embedding_plan`` of the ``none`` spec (present for every model; keys measured against a real
    0.5.23, the capture sizes shortened)."""
    return {
        "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
        "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
        "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
        "enabled": False, "matryoshka_dimensions": [],
        "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096,
                "capture_batch_sizes": [4, 8, 16, 32]},
        "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
    }  # fmt: skip


def abort_reason(message: str, status_code: int | None = None, waiting: bool = False) -> dict[str, Any]:
    """``FINISH_ABORT.to_json`` (running) or the tokenizer manager's waiting-queue abort shape."""
    if waiting:
        return {"type": "abort", "message": message}
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


# -- load (GET /get_load, GET /v1/loads) -----------------------------------------------------------------
def get_load_body(running: int, waiting: int, num_tokens: int) -> list[dict[str, Any]]:
    """0.5.9's deprecated ``/get_load``: one ``GetLoadReqOutput`` per DP rank, dataclass fields in order
    (``BaseReq``'s ``rid`` and ``http_worker_ipc`` first, both null; ``dp_rank`` null without DP).
    ``num_reqs`` counts running + waiting, and ``num_tokens`` adds the waiting requests' lengths to the
    KV tokens in use (``scheduler_metrics_mixin.get_load``)."""
    return [
        {
            "rid": None,
            "http_worker_ipc": None,
            "dp_rank": None,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": num_tokens,
            "ts_tic": time.perf_counter(),
        }
    ]


def v1_loads_body(
    *,
    version: str,
    running: int,
    waiting: int,
    used_tokens: int,
    max_total_num_tokens: int,
    gen_throughput: float,
    cache_hit_rate: float,
    max_running_requests: int,
    retracted: int,
    token_capacity: int,
) -> dict[str, Any]:
    """0.5.9's ``/v1/loads`` (``entrypoints/v1_loads.py``, default ``include=all``): per DP rank a
    ``GetLoadsReqOutput`` without its null fields (``dp_rank`` is null without DP, so absent) nor
    ``timestamp``, plus ``num_total_reqs``; then the aggregate. ``utilization`` is 0 unless the server
    was given an SLO bound (``max_running_requests_under_SLO``); ``speculative`` and ``lora`` are null
    (absent) without speculative decoding or LoRA; ``queues.retracted`` is the last retraction's count."""
    usage = round(used_tokens / max_total_num_tokens, 4) if max_total_num_tokens > 0 else 0.0
    load = {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used_tokens,
        "max_total_num_tokens": max_total_num_tokens,
        "token_usage": usage,
        "gen_throughput": round(gen_throughput, 2),
        "cache_hit_rate": round(cache_hit_rate, 4),
        "utilization": 0.0,
        "max_running_requests": max_running_requests,
        "memory": {"weight_gb": 68.5, "kv_cache_gb": 52.3, "graph_gb": 1.6, "token_capacity": token_capacity},
        "disaggregation": {
            "mode": "null",
            "prefill_prealloc_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": retracted},
        "num_total_reqs": running + waiting,
    }
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": version,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": usage,
            "avg_throughput": round(gen_throughput, 2),
            "avg_utilization": 0.0,
        },
    }
