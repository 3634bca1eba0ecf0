"""SGLang's native ``/generate`` wire format, client side — the one module that knows it.

See ../shared/reference/sglang-kimi-protocol.md §1. We send ``input_ids`` (never text), one request
per HTTP call (a batch fails as a whole), non-streaming, with a unique ``rid`` per attempt, and read
``output_ids`` + ``meta_info`` defensively (keys vary across SGLang versions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Sampling keys we forward to SGLang (anything else in a job record is ours).
SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
)


class ServerFault(Exception):
    """The server misbehaved (5xx, dropped connection, malformed or inconsistent response): retry."""

    error_class = "server_fault"


class QueueFull(ServerFault):
    """503 "The request queue is full." or a waiting/running timeout: back off and retry."""

    error_class = "queue_full"


class PermanentError(Exception):
    """The request itself is bad (400: context overflow, invalid ids/params): never retried blindly."""

    def __init__(self, error_class: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Generation:
    """One validated /generate result."""

    output_ids: list[int]
    finish_type: str  # stop | length | abort
    finish_matched: str | None  # the matched stop id/string, as text
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    num_retractions: int
    weight_version: str
    e2e_latency_s: float | None
    rid: str


def build_request(input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
    """The JSON body of one /generate call."""
    params = {k: sampling_params[k] for k in SAMPLING_KEYS if sampling_params.get(k) is not None}
    # Ids are the product; keep special tokens and the stop token verbatim in `text` too.
    params["skip_special_tokens"] = False
    params["no_stop_trim"] = True
    return {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": params,
        "stream": False,
        "require_reasoning": True,
    }


def error_message(body: bytes) -> str:
    """The message of an SGLang error body (either `{"error":{"message"}}` or ErrorResponse)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


def classify_http_error(status: int, body: bytes) -> Exception:
    """Map an HTTP error to ServerFault (retry) or PermanentError (dead-letter)."""
    message = error_message(body)
    if status == 503:
        return QueueFull(f"503: {message}")
    if status >= 500 or status in (408, 429):
        return ServerFault(f"{status}: {message}")
    lowered = message.lower()
    if "context length" in lowered or "exceeds the maximum allowed length" in lowered:
        return PermanentError("context_overflow", message, status)
    if "duplicate request id" in lowered:
        # Our rids are unique per attempt; a duplicate means a previous attempt is still running.
        return ServerFault(f"{status}: {message}")
    return PermanentError("invalid_request", message, status)


def parse_response(data: Any, rid: str, max_new_tokens: int | None) -> Generation:
    """Validate a non-streaming single-request response; inconsistencies are server faults, not data."""
    if not isinstance(data, dict):
        raise ServerFault(f"expected a JSON object from /generate, got {type(data).__name__}")
    output_ids = data.get("output_ids")
    meta = data.get("meta_info")
    if not isinstance(output_ids, list) or not isinstance(meta, dict):
        raise ServerFault(
            "response has no output_ids/meta_info (SGLang < 0.5.0 in tokenizer mode? run >= 0.5.5 "
            "or --skip-tokenizer-init)"
        )
    if not all(isinstance(t, int) and t >= 0 for t in output_ids):
        raise ServerFault("output_ids contains a non-integer or negative id")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(output_ids):
        # SGLang 0.5.0–0.5.4 could leak prompt ids into output_ids (sglang#17240).
        raise ServerFault(f"len(output_ids)={len(output_ids)} != meta_info.completion_tokens={completion}")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise ServerFault(f"malformed finish_reason {finish!r}")
    finish_type = finish["type"]
    if finish_type == "abort":
        status = finish.get("status_code")
        message = str(finish.get("message", "aborted"))
        if status == 400:
            raise PermanentError("invalid_request", message, 400)
        raise ServerFault(f"request aborted by the server: {message}")
    if finish_type == "length" and max_new_tokens is not None and len(output_ids) > max_new_tokens:
        raise ServerFault(f"{len(output_ids)} ids exceed max_new_tokens={max_new_tokens}")
    matched = finish.get("matched")
    if finish_type == "length":
        matched = None
    latency = meta.get("e2e_latency")
    return Generation(
        output_ids=output_ids,
        finish_type=finish_type,
        finish_matched=None if matched is None else str(matched),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=len(output_ids),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        reasoning_tokens=int(meta.get("reasoning_tokens") or 0),
        num_retractions=int(meta.get("num_retractions") or 0),
        weight_version=str(meta.get("weight_version") or "default"),
        e2e_latency_s=float(latency) if isinstance(latency, int | float) else None,
        rid=str(meta.get("id") or rid),
    )


@dataclass(frozen=True)
class ServerInfo:
    """What preflight learned from /model_info and /server_info."""

    model_path: str
    weight_version: str
    reasoning_parser: str | None
    effective_max_running_requests: int | None
    context_length: int | None


def parse_server_info(model_info: dict[str, Any], server_info: dict[str, Any]) -> ServerInfo:
    states = server_info.get("internal_states") or []
    effective = None
    if states and isinstance(states[0], dict):
        values = [s.get("effective_max_running_requests_per_dp") for s in states]
        if all(isinstance(v, int) for v in values):
            effective = sum(values)  # one scheduler per DP rank
    if effective is None and isinstance(server_info.get("max_running_requests"), int):
        effective = server_info["max_running_requests"]
    context = server_info.get("context_length")
    return ServerInfo(
        model_path=str(model_info.get("model_path") or server_info.get("model_path") or ""),
        weight_version=str(model_info.get("weight_version") or "default"),
        reasoning_parser=server_info.get("reasoning_parser"),
        effective_max_running_requests=effective,
        context_length=context if isinstance(context, int) else None,
    )
