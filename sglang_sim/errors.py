"""How the simulated server refuses a request: SGLang's error paths, each an exception and the body it answers with.

The validation modules (:mod:`sglang_sim.request`, :mod:`sglang_sim.sampling`) raise these exceptions and the
routes (:mod:`sglang_sim.generate`, :mod:`sglang_sim.server`) turn them into bodies; both sides need the same
names and wording, so they live here, apart from either. Wording and shapes are SGLang's (checked against the
0.5.9 and 0.5.23 wheels: ``entrypoints/http_server.py``, ``managers/tokenizer_manager.py``).

Error paths, as in SGLang (which of them applies depends on the release, :mod:`sglang_sim.versions`):

- :class:`InvalidBody` — the body is not JSON or has wrong types (FastAPI's ``RequestValidationError``,
  turned into 400): ``{"object":"error","message":…,"type":"Bad Request","param":null,"code":400}``.
- :func:`sglang_sim.sampling.contract_error` (0.5.22+) — a sampling key the api/v1 schema does not know, or a
  value of the wrong JSON type: 400 ``{"error": "<serde message>"}`` (a *string*), streamed or not.
- :class:`BadRequest` — a ``ValueError`` raised while validating (empty input, too long, bad sampling
  params, duplicate rid): 400 ``{"error":{"message":…}}``; for ``stream: true`` SGLang has already
  started the SSE response, so it is one ``data: {"error":…}`` chunk and ``data: [DONE]`` with 200.
- :class:`InternalError` (before 0.5.22) — ``SamplingParams(**sampling_params)`` raises TypeError on an
  unknown key (and comparisons do on a non-numeric number): FastAPI answers 500 ``Internal Server
  Error`` as text/plain; a stream has already sent its 200 headers and the connection just closes.
"""

from __future__ import annotations

from typing import Any

QUEUE_FULL_MESSAGE = "The request queue is full."


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
