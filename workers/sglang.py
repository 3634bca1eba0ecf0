"""SGLang's native ``/generate`` wire format, client side — the one module that knows it.

Checked against the 0.5.9 wheel's ``io_struct.py`` / ``http_server.py``; what changes up to 0.5.23:
docs/sglang-versions.md. We send ``input_ids``
(never text), one request per HTTP call (a batch fails as a whole), non-streaming, with a unique ``rid``
per attempt, and read ``output_ids`` + ``meta_info`` defensively: every shape from 0.5.9 (the deployed
release) to 0.5.23 parses, and a count the server did not report stays None (a null column).

What is never stored: a NaN stop (its last id was written by the server, not sampled — :class:`NanStop`,
retried), an abort (by its status: 4xx dead-letters, the rest retries), a bad or inconsistent answer
(:class:`BadOutput`: an id outside ``[0, vocab)``, more ids than ``max_new_tokens``, a count that is negative,
past int32 or disagrees with the ids — retried, then dead-lettered ``bad_output`` with the answer kept), so
every row that reaches a commit group encodes. What is
never sent (:func:`check_request`): an id at or above the vocabulary (neither release checks input ids;
on the GPU it is an out-of-range embedding lookup) or a prompt + ``max_new_tokens`` past the context
length (``>=`` up to 0.5.10, ``>`` from 0.5.11).

What the server is (:func:`parse_server_info`) includes its launch record: every ``/server_info`` argument but the
live state, secrets redacted, and a digest of what configures it (:func:`launch_record`), which a row names
(``server_config``) and workers/provenance.py records beside the job's output.

One file because the house keeps SGLang's wire format in exactly one module: what is sent, what an answer
means, and what the server says it is are read against the same releases, and split apart they would drift.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

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

#: The sampling-dict key (ours, never forwarded in ``sampling_params``) that asks for logprobs: K = how many
#: top alternatives per output token (0: the chosen token's logprob only). Absent/None: no logprobs.
LOGPROBS_KEY = "logprobs"


class ServerFault(Exception):
    """The server misbehaved (5xx, dropped connection, malformed or inconsistent response): retry."""

    error_class = "server_fault"
    #: The dead-letter class once this fault outlasts every retry; None → ``retries_exhausted:<error_class>``.
    exhausted_class: str | None = None
    #: The server did answer (a bad sample or a bad answer, not an outage): no sign the whole server is down.
    answered: bool = False


class QueueFull(ServerFault):
    """503 "The request queue is full." or a waiting/running timeout: back off and retry."""

    error_class = "queue_full"


class Unanswered(ServerFault):
    """No answer: the deadline passed, or the connection was refused or dropped."""

    error_class = "unanswered"


class NanStop(ServerFault):
    """``finish_reason {"type": "stop", "matched": "NaN happened"}``: the server sampled a NaN or an
    out-of-vocabulary id and overwrote the last output id with a stop id. That id was never generated:
    the output is a server fault, retried like a 503, and dead-lettered as ``nan_stop`` if it repeats."""

    error_class = "nan_stop"
    exhausted_class = "nan_stop"
    answered = True


class BadOutput(ServerFault):
    """A 200 answer whose content cannot be a generation: an output id outside ``[0, vocab_size)`` (or, the
    vocabulary unknown, outside int32), a ``stop``/``length`` finish with more ids than ``max_new_tokens``, a
    count that is negative, past int32 or inconsistent with the ids, logprobs that do not line up. Checked
    when the answer arrives, so such a row never joins a commit group (where it would fail the whole
    group's encode). Retried like any server fault, dead-lettered ``bad_output`` once retries run out;
    :attr:`answer` (an excerpt of what the server sent, :func:`answer_excerpt`) goes into the dead letter."""

    error_class = "bad_output"
    exhausted_class = "bad_output"
    answered = True

    def __init__(self, message: str, answer: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.answer = answer


class ServerAbort(ServerFault):
    """``finish_reason.type == "abort"`` with no status, a 5xx or a retryable 4xx (408, 429)."""

    error_class = "server_abort"


class PermanentError(Exception):
    """The request itself is bad (400: context overflow, invalid ids/params): never retried blindly."""

    def __init__(
        self, error_class: str, message: str, status: int | None = None, answer: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.status = status
        #: What the server answered (``bad_output``: :func:`answer_excerpt`), kept in the dead letter.
        self.answer = answer


class ImageTokensMismatch(PermanentError):
    """An image prompt the server did not run as sent: ``prompt_tokens`` is not ``len(input_ids) − n_images +
    Σ image tokens``, or (≥ 0.5.13) ``prompt_token_ids`` is not the ids sent with each placeholder expanded. The
    same ids and images make the same count again, so it is not retried: dead-lettered ``bad_output`` at once,
    with the server's answer kept — never a row whose prompt is not what the model saw."""

    def __init__(self, message: str, answer: dict[str, Any]) -> None:
        super().__init__("bad_output", f"image prompt: {message}", answer=answer)


@dataclass(frozen=True)
class ExpectedPrompt:
    """What an image prompt's answer must show of its prompt: the expanded length, and (when asked for with
    ``return_prompt_token_ids``) the expanded ids themselves."""

    n_ids: int
    n_images: int
    length: int
    ids: list[int] | None = None


@dataclass(frozen=True)
class ImagePrompt:
    """What an image prompt's request carries beside its ids, and what its answer must show."""

    #: One ``data:`` URI per placeholder (ASCII bytes, or str): spliced into the body as they are (:func:`body_pieces`).
    image_data: list[bytes] | list[str]
    expected: ExpectedPrompt
    #: Ask for ``return_prompt_token_ids`` (SGLang ≥ 0.5.13): the answer's ids are checked against ``expected.ids``.
    return_prompt_token_ids: bool
    #: Bytes of the worker's image budget this request holds (workers/images.py ``ImageSender.release``).
    held_bytes: int = 0


#: ``finish_reason.matched`` of a NaN / out-of-vocab sample (scheduler output processing, every version).
NAN_MATCHED = "NaN happened"


@dataclass(frozen=True)
class Generation:
    """One validated /generate result. A count the server did not report is None, never a guess."""

    output_ids: list[int]
    finish_type: str  # stop | length
    finish_matched: str | None  # the matched stop id/string, as text
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None  # absent before SGLang 0.5.10
    num_retractions: int | None  # ``total_retractions`` up to 0.5.11, ``num_retractions`` from 0.5.12
    weight_version: str
    e2e_latency_s: float | None
    rid: str
    #: ``--logprobs K``: the chosen token's logprob per output id (None: not requested), and with K > 0 the
    #: top-K alternatives per output id (ids and logprobs, best first). A logprob JSON null (orjson writes
    #: -inf as null) reads as -inf.
    output_logprobs: list[float] | None = None
    top_logprob_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    #: Speculative decoding (the server runs ``--speculative-algorithm``; None otherwise): verify steps, draft
    #: tokens accepted and proposed, and how many steps accepted 0, 1, 2, … drafts (:data:`SPEC_KEYS`).
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int | None = None
    spec_draft_tokens: int | None = None
    spec_accept_histogram: list[int] | None = None
    #: An image prompt on SGLang ≥ 0.5.13 (``return_prompt_token_ids``): the ids the server ran, each image's
    #: placeholder expanded — checked equal to the ids sent with each placeholder expanded by its count.
    prompt_token_ids: list[int] | None = None


#: A finished answer's speculative-decoding figures, per release: 0.5.9 ``tokenizer_manager.py:1851-1867``
#: (``_calculate_spec_decoding_metrics``: only when a verify step ran); 0.5.23 renamed the counts (its
#: ``tokenizer_manager.py:3164-3201``). Each entry: (our name, the names SGLang has used, oldest first).
SPEC_KEYS = (
    ("spec_verify_ct", ("spec_verify_ct",)),
    ("spec_accepted_tokens", ("spec_accept_token_num", "spec_num_correct_drafts")),
    ("spec_draft_tokens", ("spec_draft_token_num", "spec_num_proposed_drafts")),
)
SPEC_HISTOGRAM_KEYS = ("spec_accept_histogram", "spec_correct_drafts_histogram")


def spec_figures(meta: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures of ``meta`` as :class:`Generation` keywords; a figure absent or not a count stays
    None (a side signal of the server's, never a reason to refuse the generation it rides with)."""
    if "spec_verify_ct" not in meta:  # no speculative decoding: one dict lookup per answer
        return {}
    out: dict[str, Any] = {name: _count(meta, *keys) for name, keys in SPEC_KEYS}
    for key in SPEC_HISTOGRAM_KEYS:
        value = meta.get(key)
        if isinstance(value, list) and all(_is_count(v) for v in value):
            out["spec_accept_histogram"] = value
            break
    return out


def build_request(
    input_ids: list[int],
    sampling_params: dict[str, Any],
    rid: str,
    image_data: list[str] | None = None,
    return_prompt_token_ids: bool = False,
) -> dict[str, Any]:
    """The JSON body of one /generate call. An image prompt adds ``image_data`` (one ``data:`` URI per placeholder,
    in order: ``GenerateReqInput.image_data``) and, on SGLang ≥ 0.5.13, ``return_prompt_token_ids`` (the answer's
    top-level ``prompt_token_ids``: 0.5.23 ``managers/tokenizer_manager.py`` ``_handle_batch_output``)."""
    params = {k: sampling_params[k] for k in SAMPLING_KEYS if sampling_params.get(k) is not None}
    # Ids are the product; keep special tokens and the stop token verbatim in `text` too.
    params["skip_special_tokens"] = False
    params["no_stop_trim"] = True
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": params,
        "stream": False,
        "require_reasoning": True,
    }
    if image_data:
        body["image_data"] = image_data
        if return_prompt_token_ids:
            body["return_prompt_token_ids"] = True
    k = sampling_params.get(LOGPROBS_KEY)
    if k is not None:
        # logprob_start_len -1 (SGLang's default): output logprobs, plus one input position (ignored).
        body.update(return_logprob=True, top_logprobs_num=int(k), logprob_start_len=-1, return_text_in_logprobs=False)
    return body


def body_pieces(
    input_ids: list[int],
    sampling_params: dict[str, Any],
    rid: str,
    image_data: list[bytes] | list[str] | None = None,
    return_prompt_token_ids: bool = False,
) -> list[bytes]:
    """:func:`build_request`'s body serialised, as pieces to write one after the other: an image prompt's ``data:``
    URIs (ASCII, nothing to escape) are spliced in as they are, so a request holds no copy of its images beside the
    worker's cache (a text prompt's body is one piece)."""
    body = build_request(input_ids, sampling_params, rid, None, False)
    if not image_data:
        return [orjson.dumps(body)]
    if return_prompt_token_ids:
        body["return_prompt_token_ids"] = True
    pieces = [orjson.dumps(body)[:-1] + b',"image_data":["']
    for k, uri in enumerate(image_data):
        if k:
            pieces.append(b'","')
        pieces.append(uri if isinstance(uri, bytes) else uri.encode("ascii"))
    pieces.append(b'"]}')
    return pieces


def error_message(body: bytes) -> str:
    """The message of an SGLang error body: ``{"error": {"message"}}``, ``{"error": "<str>"}`` (0.5.22+) or
    an ErrorResponse ``{"object": "error", "message", …}``; anything else (0.5.9's plain-text 500) as text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):  # 0.5.22+: the sampling-params contract check's 400 {"error": "<str>"}
            return err
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


def classify_http_error(status: int, body: bytes) -> Exception:
    """Map an HTTP error to ServerFault (retry) or PermanentError (dead-letter)."""
    return classify_status(status, error_message(body))


def classify_status(status: int, message: str) -> Exception:
    """An HTTP status (or an abort's ``status_code``) and its message → retry or dead letter."""
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


def classify_abort(finish: dict[str, Any]) -> Exception:
    """An abort finish by its ``status_code``: 4xx is the request's fault (dead letter with the message);
    no status (an abort from the waiting queue), 5xx, 408 and 429 are the server's (retry)."""
    status = finish.get("status_code")
    message = str(finish.get("message") or "aborted")
    err_type = finish.get("err_type")
    code = status if isinstance(status, int) and not isinstance(status, bool) else None
    what = f"{code}" if code is not None else "no status"
    text = f"request aborted by the server ({what}{f', {err_type}' if err_type else ''}): {message}"
    if code is not None and 400 <= code < 500:
        verdict = classify_status(code, message)
        if isinstance(verdict, PermanentError):
            return PermanentError(verdict.error_class, text, code)
    if code == 503:
        return QueueFull(text)
    return ServerAbort(text)


#: Ids and counts land in int32 Parquet columns (storage/schema.py): the id bound when the vocabulary is unknown.
INT32_LIMIT = 2**31
#: The ``meta_info`` counts a row stores; a present one must be an int in ``[0, 2**31)``.
COUNT_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "num_retractions",
    "total_retractions",
)
#: What :func:`answer_excerpt` keeps: the first output ids, the first entries of each ``meta_info`` list
#: (the logprobs), the first characters of the text.
ANSWER_IDS_KEPT = 4096
ANSWER_LIST_KEPT = 16
ANSWER_TEXT_KEPT = 2000


def answer_excerpt(data: Any) -> dict[str, Any]:
    """What a ``bad_output`` dead letter keeps of the server's answer: the first :data:`ANSWER_IDS_KEPT`
    output ids and how many there were, ``meta_info`` with each list cut to :data:`ANSWER_LIST_KEPT`
    entries, and the start of ``text``."""
    if not isinstance(data, dict):
        return {"body": repr(data)[:ANSWER_TEXT_KEPT]}
    out: dict[str, Any] = {}
    ids = data.get("output_ids")
    if isinstance(ids, list):
        out["output_ids"] = ids[:ANSWER_IDS_KEPT]
        out["output_ids_count"] = len(ids)
    elif ids is not None:
        out["output_ids"] = repr(ids)[:ANSWER_TEXT_KEPT]
    meta = data.get("meta_info")
    if isinstance(meta, dict):
        out["meta_info"] = {k: v[:ANSWER_LIST_KEPT] if isinstance(v, list) else v for k, v in meta.items()}
    text = data.get("text")
    if isinstance(text, str):
        out["text"] = text[:ANSWER_TEXT_KEPT]
    prompt_ids = data.get("prompt_token_ids")
    if isinstance(prompt_ids, list):  # an image prompt's expanded ids: what the server ran
        out["prompt_token_ids"] = prompt_ids[:ANSWER_IDS_KEPT]
        out["prompt_token_ids_count"] = len(prompt_ids)
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < INT32_LIMIT


def check_counts(meta: dict[str, Any], n_output: int, prompt_len: int | None = None) -> None:
    """Raise :class:`BadOutput` for a count that is present but not an int in ``[0, 2**31)``, or that
    disagrees with the ids: ``completion_tokens != len(output_ids)`` (SGLang 0.5.0–0.5.4 could leak prompt
    ids into output_ids, sglang#17240), ``prompt_tokens != len(input_ids)``, more ``reasoning_tokens`` than
    output ids. A count the server left out (absent or null) is not checked: it stays None."""
    for name in COUNT_KEYS:
        value = meta.get(name)
        if value is not None and not _is_count(value):
            raise BadOutput(f"meta_info.{name}={value!r} is not a count (an int in [0, 2**31))")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != n_output:
        raise BadOutput(f"len(output_ids)={n_output} != meta_info.completion_tokens={completion}")
    prompt = meta.get("prompt_tokens")
    if prompt is not None and prompt_len is not None and prompt != prompt_len:
        raise BadOutput(f"meta_info.prompt_tokens={prompt} != the {prompt_len} prompt ids sent")
    reasoning = meta.get("reasoning_tokens")
    if reasoning is not None and reasoning > n_output:
        raise BadOutput(f"meta_info.reasoning_tokens={reasoning} > len(output_ids)={n_output}")


def check_output_ids(output_ids: list[Any], vocab_size: int | None) -> None:
    """Raise :class:`BadOutput` unless every id is an int in ``[0, vocab_size)`` (``[0, 2**31)`` when the
    vocabulary is unknown). One C-level pass over the types (bool is not int here), then min()/max()."""
    if not output_ids:
        return
    if set(map(type, output_ids)) != {int}:
        bad = next(v for v in output_ids if type(v) is not int)
        raise BadOutput(f"output_ids holds {bad!r} at position {output_ids.index(bad)}: not an integer id")
    bound = vocab_size if vocab_size else INT32_LIMIT
    low, high = min(output_ids), max(output_ids)
    if low < 0 or high >= bound:
        bad = low if low < 0 else high
        what = f"the vocabulary size {vocab_size}" if vocab_size else "2**31 (int32; vocabulary unknown)"
        raise BadOutput(
            f"output id {bad} at position {output_ids.index(bad)} of {len(output_ids)} is outside [0, {bound}): "
            f"{'negative' if bad < 0 else f'>= {what}'}"
        )


def _count(meta: dict[str, Any], *names: str) -> int | None:
    """The first of ``names`` that ``meta`` holds as a count (:func:`check_counts` refused any other
    value); None when none is there."""
    for name in names:
        value = meta.get(name)
        if _is_count(value):
            return value
    return None


def _logprob(value: Any, where: str) -> float:
    if value is None:  # orjson (SGLang's ORJSONResponse) writes -inf and NaN as null
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadOutput(f"{where}: logprob {value!r} is not a number")
    return float(value)


def _triple(entry: Any, where: str, bound: int = INT32_LIMIT) -> tuple[float, int]:
    """One ``[logprob, token_id, text_or_null]`` (``detokenize_logprob_tokens``) → (logprob, id in
    ``[0, bound)``)."""
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        raise BadOutput(f"{where}: expected [logprob, token_id, text], got {entry!r}"[:300])
    token = entry[1]
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < bound:
        raise BadOutput(f"{where}: token id {token!r} is not an id in [0, {bound})")
    return _logprob(entry[0], where), token


def parse_logprobs(
    meta: dict[str, Any], output_ids: list[int], top_k: int | None, vocab_size: int | None = None
) -> tuple[list[float] | None, list[list[int]] | None, list[list[float]] | None]:
    """``meta_info.output_token_logprobs`` (one ``[logprob, id, text|null]`` per output id) and, when
    ``top_k`` > 0, ``output_top_logprobs`` (per output id a list of such triples, or null) → (chosen
    logprobs, top ids, top logprobs), each aligned with ``output_ids``. ``top_k`` None: not requested —
    nothing is read. A misaligned, missing or malformed answer, or a top id outside ``[0, vocab_size)``
    (int32 when unknown), is a :class:`BadOutput` (retried, then dead-lettered ``bad_output``)."""
    if top_k is None:
        return None, None, None
    bound = vocab_size or INT32_LIMIT
    chosen = meta.get("output_token_logprobs")
    n = len(output_ids)
    if not isinstance(chosen, list):
        raise BadOutput("logprobs were requested but meta_info has no output_token_logprobs list")
    if len(chosen) != n:
        raise BadOutput(f"len(output_token_logprobs)={len(chosen)} != len(output_ids)={n}")
    logprobs: list[float] = []
    for i, entry in enumerate(chosen):
        value, token = _triple(entry, f"output_token_logprobs[{i}]", bound)
        if token != output_ids[i]:
            raise BadOutput(f"output_token_logprobs[{i}] is for id {token}, output_ids[{i}] is {output_ids[i]}")
        logprobs.append(value)
    if top_k <= 0:
        return logprobs, None, None
    top = meta.get("output_top_logprobs")
    if not isinstance(top, list) or len(top) != n:
        got = len(top) if isinstance(top, list) else type(top).__name__
        raise BadOutput(f"top_logprobs_num={top_k} was requested: output_top_logprobs has {got} entries, not {n}")
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for i, alternatives in enumerate(top):
        pairs = [_triple(e, f"output_top_logprobs[{i}]", bound) for e in alternatives or ()]  # null: none
        if len(pairs) > top_k:
            raise BadOutput(f"output_top_logprobs[{i}] has {len(pairs)} entries > top_logprobs_num={top_k}")
        top_values.append([v for v, _ in pairs])
        top_ids.append([t for _, t in pairs])
    return logprobs, top_ids, top_values


def parse_response(
    data: Any,
    rid: str,
    max_new_tokens: int | None,
    logprobs: int | None = None,
    vocab_size: int | None = None,
    prompt_len: int | None = None,
    expected: ExpectedPrompt | None = None,
) -> Generation:
    """Validate a non-streaming single-request response; inconsistencies are server faults, not data.

    Reads every ``meta_info`` shape from SGLang 0.5.9 to 0.5.23 (docs/sglang-versions.md):
    the retraction count is ``total_retractions`` (≤ 0.5.11) or ``num_retractions`` (≥ 0.5.12);
    ``reasoning_tokens`` exists from 0.5.10 — absent, it stays None (stored as null). ``logprobs`` (the
    job's K, None when not asked): the answer must carry aligned logprobs (:func:`parse_logprobs`); when
    None, logprobs are still read if the answer has them (the client passes only ``max_new_tokens``).

    Every row it returns can be stored: each output (and top-logprob) id is an int in ``[0, vocab_size)``
    (``[0, 2**31)`` when the vocabulary is unknown), a ``stop``/``length`` finish has at most
    ``max_new_tokens`` ids, every count is an int32 consistent with the ids (``prompt_len``: the prompt ids
    sent). Anything else raises :class:`BadOutput` carrying :func:`answer_excerpt` of the answer. An image
    prompt (``expected``) is checked against its expanded prompt instead (:func:`check_image_prompt`).
    """
    try:
        gen = _parse_response(data, rid, max_new_tokens, logprobs, vocab_size, None if expected else prompt_len)
    except BadOutput as exc:
        if exc.answer is None:
            exc.answer = answer_excerpt(data)
        raise
    if expected is None:
        return gen
    return check_image_prompt(gen, data, expected)


def check_image_prompt(gen: Generation, data: dict[str, Any], expected: ExpectedPrompt) -> Generation:
    """``gen`` with the server's expanded ids when its prompt is the one sent (:class:`ImageTokensMismatch`
    otherwise): ``meta_info.prompt_tokens`` = the expanded length, and the returned ``prompt_token_ids`` (asked
    for: ``expected.ids``) equal to the ids sent with each placeholder expanded by its image's count."""
    reported = data["meta_info"].get("prompt_tokens")
    if reported != expected.length:
        raise ImageTokensMismatch(
            f"meta_info.prompt_tokens={reported!r} != {expected.length} ({expected.n_ids} ids − {expected.n_images} "
            f"placeholder(s) + the images' token counts): the server's image processor counts these images "
            "differently (another preprocessor_config.json, or a re-tokenization drift)",
            answer_excerpt(data),
        )
    if expected.ids is None:
        return gen
    returned = data.get("prompt_token_ids")
    if not isinstance(returned, list):
        raise ImageTokensMismatch(
            "return_prompt_token_ids was asked for (SGLang >= 0.5.13) and the answer has no prompt_token_ids list",
            answer_excerpt(data),
        )
    if returned != expected.ids:
        at = next((i for i, (a, b) in enumerate(zip(returned, expected.ids, strict=False)) if a != b), None)
        where = f"first difference at {at}" if at is not None else "one is a prefix of the other"
        raise ImageTokensMismatch(
            f"prompt_token_ids ({len(returned)} ids) != the ids sent with each placeholder expanded "
            f"({len(expected.ids)} ids; {where})",
            answer_excerpt(data),
        )
    return replace(gen, prompt_token_ids=expected.ids)


def _parse_response(
    data: Any,
    rid: str,
    max_new_tokens: int | None,
    logprobs: int | None,
    vocab_size: int | None,
    prompt_len: int | None,
) -> Generation:
    if not isinstance(data, dict):
        raise ServerFault(f"expected a JSON object from /generate, got {type(data).__name__}")
    output_ids = data.get("output_ids")
    meta = data.get("meta_info")
    if not isinstance(output_ids, list) or not isinstance(meta, dict):
        raise ServerFault(
            "response has no output_ids/meta_info (SGLang < 0.5.0 in tokenizer mode? run >= 0.5.5 "
            "or --skip-tokenizer-init)"
        )
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise ServerFault(f"malformed finish_reason {finish!r}")
    finish_type = finish["type"]
    if finish_type == "abort":
        raise classify_abort(finish)
    matched = finish.get("matched")
    if finish_type == "stop" and matched == NAN_MATCHED:
        last = output_ids[-1] if output_ids else None
        raise NanStop(
            f"NaN stop (rid {meta.get('id') or rid}): the server overwrote the last of {len(output_ids)} output "
            f"ids with a stop id ({last}); that id was never sampled"
        )
    check_output_ids(output_ids, vocab_size)
    check_counts(meta, len(output_ids), prompt_len)
    if max_new_tokens is not None and len(output_ids) > max_new_tokens:
        # A stop id counts against the budget too (no_stop_trim keeps it): neither finish can pass it.
        raise BadOutput(f"a {finish_type!r} finish with {len(output_ids)} ids > max_new_tokens={max_new_tokens}")
    if finish_type == "length":
        matched = None
    latency = meta.get("e2e_latency")
    if logprobs is None and isinstance(meta.get("output_token_logprobs"), list):
        top = meta.get("output_top_logprobs")
        logprobs = max((len(t) for t in top if isinstance(t, list)), default=1) if isinstance(top, list) else 0
    chosen, top_ids, top_values = parse_logprobs(meta, output_ids, logprobs, vocab_size)
    return Generation(
        output_ids=output_ids,
        finish_type=finish_type,
        finish_matched=None if matched is None else str(matched),
        prompt_tokens=_count(meta, "prompt_tokens") or 0,
        completion_tokens=len(output_ids),
        cached_tokens=_count(meta, "cached_tokens"),
        reasoning_tokens=_count(meta, "reasoning_tokens"),
        num_retractions=_count(meta, "num_retractions", "total_retractions"),
        weight_version=str(meta.get("weight_version") or "default"),
        e2e_latency_s=float(latency) if isinstance(latency, int | float) else None,
        rid=str(meta.get("id") or rid),
        output_logprobs=chosen,
        top_logprob_ids=top_ids,
        top_logprobs=top_values,
        **spec_figures(meta),
    )


# -- what the server is ---------------------------------------------------------------------------------
#: First release whose context check is ``input + max_new_tokens > context`` (``>=`` up to 0.5.10).
STRICT_CONTEXT_CHECK_FROM = (0, 5, 11)
#: First release that keeps an image prompt's ids (expanding only its placeholders; before, it decodes and
#: re-tokenizes them) and answers ``return_prompt_token_ids`` (sglang PR #26555; docs/sglang-versions.md).
PROMPT_TOKEN_IDS_FROM = (0, 5, 13)


def parse_version(text: Any) -> tuple[int, int, int] | None:
    """``"0.5.9"``, ``"0.5.10rc0"``, ``"v0.5.9.post1"`` → (0, 5, 9); None when there is no version."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


@dataclass(frozen=True)
class ServerInfo:
    """What preflight learned from /model_info and /server_info (None: the server did not say)."""

    model_path: str
    weight_version: str
    reasoning_parser: str | None
    effective_max_running_requests: int | None
    context_length: int | None
    version: str | None = None
    vocab_size: int | None = None
    max_req_input_len: int | None = None
    deterministic: bool | None = None  # --enable-deterministic-inference (sampling_seed is honoured)
    max_total_num_tokens: int | None = None  # the KV pool, tokens (the adaptive in-flight bound reads it)
    #: The launch record (:func:`launch_record`): every /server_info argument, secrets redacted, and /model_info as
    #: answered; ``config_digest`` names what configures the server (a row's ``server_config``).
    launch_args: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    model_info: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    config_digest: str | None = None

    @property
    def context_check_inclusive(self) -> bool:
        """True when the server refuses ``input + max_new_tokens >= context`` (≤ 0.5.10, and an unknown
        version: the stricter check); False from 0.5.11, which refuses only ``>``."""
        version = parse_version(self.version)
        return version is None or version < STRICT_CONTEXT_CHECK_FROM

    @property
    def returns_prompt_token_ids(self) -> bool:
        """True from SGLang 0.5.13: an image prompt's ids are kept (``SGLANG_MM_AVOID_RETOKENIZE``, default on)
        and ``return_prompt_token_ids`` returns them expanded; False before, or when the version is unknown."""
        version = parse_version(self.version)
        return version is not None and version >= PROMPT_TOKEN_IDS_FROM

    @property
    def image_understanding(self) -> bool | None:
        """``/model_info.has_image_understanding`` (None: the server did not say)."""
        value = self.model_info.get("has_image_understanding")
        return value if isinstance(value, bool) else None


def _positive_int(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parse_server_info(
    model_info: dict[str, Any], server_info: dict[str, Any], models: dict[str, Any] | None = None
) -> ServerInfo:
    """``/model_info``, ``/server_info`` and (optional) ``/v1/models`` → :class:`ServerInfo`.

    The context length is the model's effective one: ``/v1/models`` ``data[].max_model_len`` when given,
    else ``/server_info`` ``context_length`` (the raw ``--context-length``: null unless it was set).
    """
    served = (models or {}).get("data") or []
    max_model_len = served[0].get("max_model_len") if served and isinstance(served[0], dict) else None
    states = server_info.get("internal_states") or []
    state0 = states[0] if states and isinstance(states[0], dict) else {}
    effective = None
    if state0:
        values = [s.get("effective_max_running_requests_per_dp") if isinstance(s, dict) else None for s in states]
        if all(isinstance(v, int) for v in values):
            effective = sum(values)  # one scheduler per DP rank
    if effective is None and isinstance(server_info.get("max_running_requests"), int):
        effective = server_info["max_running_requests"]
    deterministic = server_info.get("enable_deterministic_inference")
    if not isinstance(deterministic, bool):
        deterministic = state0.get("enable_deterministic_inference")
    launch_args, digest = launch_record(model_info, server_info)
    return ServerInfo(
        model_path=str(model_info.get("model_path") or server_info.get("model_path") or ""),
        weight_version=str(model_info.get("weight_version") or "default"),
        reasoning_parser=server_info.get("reasoning_parser"),
        effective_max_running_requests=effective,
        context_length=_positive_int(
            max_model_len,
            model_info.get("context_length"),
            server_info.get("context_length"),
            state0.get("context_length"),
        ),
        version=str(server_info["version"]) if server_info.get("version") else None,
        vocab_size=_positive_int(model_info.get("vocab_size"), server_info.get("vocab_size"), state0.get("vocab_size")),
        max_req_input_len=_positive_int(server_info.get("max_req_input_len"), state0.get("max_req_input_len")),
        deterministic=deterministic if isinstance(deterministic, bool) else None,
        max_total_num_tokens=_positive_int(
            server_info.get("max_total_num_tokens"), (state0.get("memory_usage") or {}).get("token_capacity")
        ),
        launch_args=launch_args,
        model_info=dict(model_info),
        config_digest=digest,
    )


#: ``/server_info`` keys that are the server's state, not how it was launched: 0.5.9 ``http_server.py:593-610``
#: returns ``asdict(server_args)`` + ``scheduler_info`` + ``internal_states`` + ``version``; 0.5.23 adds
#: ``startup_time``, ``kv_events``, ``hicache_object_layout``, ``frontend`` (``version`` is recorded on its own).
SERVER_STATE_KEYS = frozenset(
    {"internal_states", "status", "version", "startup_time", "kv_events", "hicache_object_layout", "frontend"}
    | {"simulator"}  # sglang_sim's clock
)
#: Arguments that name one instance rather than its configuration — its address, rank, the seed SGLang draws when
#: given none (``server_args.py:853``), the KV pool its GPU's free memory sized: recorded, left out of the digest,
#: so a fleet of servers launched alike is one configuration.
INSTANCE_KEYS = frozenset(
    {"host", "port", "nccl_port", "dist_init_addr", "node_rank", "base_gpu_id", "random_seed", "launch_command"}
    | {"max_total_num_tokens", "max_req_input_len"}
)
#: The arguments a reader of a data set's provenance looks for first (``producer report``, export metadata): the
#: model and its weights, parallelism and precision, the parsers, speculative decoding, determinism. None of
#: :data:`INSTANCE_KEYS`: those differ between servers of one configuration (a record keeps them per worker).
LAUNCH_HIGHLIGHTS = (
    "model_path", "served_model_name", "revision", "weight_version", "dtype", "quantization", "kv_cache_dtype",
    "tp_size", "dp_size", "pp_size", "ep_size", "enable_dp_attention", "context_length", "reasoning_parser",
    "tool_call_parser", "speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "enable_deterministic_inference", "attention_backend", "sampling_backend",
    "max_running_requests", "chunked_prefill_size", "preferred_sampling_params", "sampling_defaults",
)  # fmt: skip
#: Arguments whose value is a credential (``--api-key``, ``--admin-api-key``, 0.5.23's watermark keys).
_SECRET = re.compile(r"(^|_)(api_key|key|key_b|secret|password)$")
REDACTED = "<redacted>"


def launch_record(model_info: Mapping[str, Any], server_info: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``/server_info`` without its live state (:data:`SERVER_STATE_KEYS`), credentials redacted, and the
    16-hex digest of what configures the server: SGLang's version, ``/model_info`` and those arguments but the
    instance's own (:data:`INSTANCE_KEYS`)."""
    args = {
        k: REDACTED if v is not None and _SECRET.search(k) else v
        for k, v in server_info.items()
        if k not in SERVER_STATE_KEYS
    }
    config = {k: v for k, v in args.items() if k not in INSTANCE_KEYS}
    identity = {"version": server_info.get("version"), "model_info": dict(model_info), "args": config}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return args, hashlib.sha256(text.encode()).hexdigest()[:16]


# -- refusing what the server would choke on ------------------------------------------------------------
@dataclass(frozen=True)
class RequestLimits:
    """What a prompt must fit before it is sent (None: unknown, not checked)."""

    vocab_size: int | None = None
    vocab_source: str = "server"
    context_length: int | None = None
    context_source: str = "server"
    max_req_input_len: int | None = None
    context_check_inclusive: bool = True
    version: str | None = None


def check_request(
    input_ids: list[int], max_new_tokens: int | None, limits: RequestLimits, image_tokens: int = 0
) -> PermanentError | None:
    """The refusal (``invalid_ids`` / ``context_overflow``, with a message naming the id or the lengths)
    of a prompt the server must never see, or None when it fits what the worker knows of the server.
    ``image_tokens``: what an image prompt's placeholders add once expanded (the server checks that length)."""
    vocab = limits.vocab_size
    if vocab is not None and input_ids:
        top = max(input_ids)
        if top >= vocab:
            at = input_ids.index(top)
            return PermanentError(
                "invalid_ids",
                f"prompt id {top} at position {at} of {len(input_ids)} is >= the vocabulary size {vocab} "
                f"({limits.vocab_source}); not sent: an out-of-vocabulary id is undefined on the GPU",
            )
    if input_ids and min(input_ids) < 0:
        return PermanentError("invalid_ids", f"prompt id {min(input_ids)} is negative; not sent")
    n = len(input_ids) + image_tokens
    ctx = limits.context_length
    where = f"({limits.context_source}{f', SGLang {limits.version}' if limits.version else ''})"
    if ctx is not None:
        if n >= ctx:
            return PermanentError(
                "context_overflow",
                f"prompt of {n} tokens is not shorter than the model's context length of {ctx} tokens "
                f"{where}; not sent",
            )
        if max_new_tokens is not None:
            total = n + max_new_tokens
            inclusive = limits.context_check_inclusive
            if total > ctx or (inclusive and total == ctx):
                rule = ">=" if inclusive else ">"
                return PermanentError(
                    "context_overflow",
                    f"prompt of {n} tokens + max_new_tokens {max_new_tokens} = {total} tokens {rule} the model's "
                    f"context length of {ctx} tokens {where}; not sent (lower max_new_tokens with `producer retry`)",
                )
    cap = limits.max_req_input_len
    if cap is not None and n >= cap:
        return PermanentError(
            "context_overflow",
            f"prompt of {n} tokens is not shorter than the server's maximum input length of {cap} tokens "
            f"(context length {ctx}) {where}; not sent",
        )
    return None
