"""``sampling_params``: SGLang's rules for them, and the api/v1 schema 0.5.22+ checks them against first.

Two checks, in the order the server runs them: :func:`contract_error` (0.5.22+, the JSON contract of
``entrypoints/api_contract.py`` / ``api/v1/api_types.py``: unknown keys and wrong JSON types, serde's wording) on
the raw body, then :func:`parse_sampling_params` per item (``sampling/sampling_params.py``: defaults,
``normalize``, ``verify``, ``raise_if_tokenizer_required``) into the :class:`SamplingParams` the simulator
generates with. Both live here because the second needs the first's field list (a contract key the simulator
does not imitate is refused as such, not as unknown). Wording checked against the 0.5.9 and 0.5.23 wheels.

Where the simulator cannot imitate a parameter (n > 1, a contract key it does not simulate) it refuses with a
400 that says so instead of returning something plausible but fake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sglang_sim.content import DEFAULT_MAX_NEW_TOKENS
from sglang_sim.errors import BadRequest, InternalError

_SAMPLING_EPS = 1e-6
_TOP_K_ALL = 1 << 30


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
