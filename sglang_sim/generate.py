"""``POST/PUT /generate``: parse, validate, inject faults, run through the engine, answer (JSON or SSE).

What differs between releases (``--sglang-version``) is read from ``sim.profile``
(:class:`sglang_sim.versions.VersionProfile`): the sampling-params contract check, duplicate rids, the
context boundary, meta_info keys, the streamed error chunk.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from aiohttp import web

from sglang_sim import errors, responses, sampling
from sglang_sim.content import (
    Generation,
    expected_generation,
    nan_generation,
    nan_overwrite_id,
    reasoning_token_count,
)
from sglang_sim.engine import QueueFullError
from sglang_sim.faults import Abort, Fault, GenerationFault
from sglang_sim.request import GenerateCall, GenerateItem, normalize_call, parse_body, validate_item
from sglang_sim.simulator import DROPPED, Call, CallItem, Simulator

#: Where an app keeps its Simulator.
SIM_KEY: web.AppKey[Simulator] = web.AppKey("sglang_sim")
#: Message of the 503 /generate answers during an outage.
OUTAGE_MESSAGE = "Service Unavailable: the server is down (sglang-sim outage)."
#: Message of the 503 /generate answers during warm-up with ``--warmup-rejects-generate``.
WARMUP_MESSAGE = "Service Unavailable: the server is warming up (sglang-sim --warmup-rejects-generate)."
#: The id an ``overlong`` bad output pads with (an ordinary filler id of every family).
FILLER_ID = 100


async def handle_generate(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    profile = sim.profile
    sim.stats.generate_calls += 1
    if sim.faults.in_outage():
        sim.faults.injected["outage_503"] += 1
        return _json(sim, errors.error_response_body(OUTAGE_MESSAGE, 503), 503)
    if sim.config.server.warmup_rejects_generate and sim.warming():
        return _json(sim, errors.error_response_body(WARMUP_MESSAGE, 503), 503)

    try:
        body = parse_body(await request.read())
    except errors.InvalidBody as exc:
        return _json(sim, exc.body, 400)
    if profile.sampling_contract:
        contract_error = sampling.contract_error(body.sampling_params)
        if contract_error is not None:  # before the stream starts: a plain 400 even for stream=true
            return _json(sim, {"error": contract_error}, 400)
    try:
        parsed = normalize_call(body, sim.codec.encode, profile.rejects_duplicate_rids)
    except ValueError as exc:
        return await _bad_request(sim, request, body.stream, str(exc))
    sim.record_rids(parsed)
    try:
        for item in parsed.items:
            if item.image_data and sim.vision is not None:
                # The tokenizer manager expands the images before its length checks; the prefill, prompt_tokens and
                # prompt_token_ids are the expanded prompt's (sglang_sim/vision.py).
                item.input_ids = sim.vision.expand(item.input_ids, item.image_data, sim.faults.config.image_token_skew)
            validate_item(item, sim.limits, sim.codec.has_tokenizer)
        if profile.rejects_duplicate_rids:
            for item in parsed.items:
                if item.rid in sim.inflight:
                    raise errors.BadRequest(f"Duplicate request ID detected: {item.rid}")
    except errors.BadRequest as exc:
        return await _bad_request(sim, request, parsed.stream, str(exc))
    except errors.InternalError:
        return await _internal_error(sim, request, parsed.stream)

    fault = sim.faults.choose(_fault_key(parsed))
    if fault is Fault.UNAVAILABLE:
        return await _queue_full(sim, request, parsed)
    call = Call(sim, parsed)
    sim.calls.add(call)
    try:
        if fault is Fault.HANG:
            return await _hang(sim, request, call)
        for item in parsed.items:
            call.items.append(_call_item(sim, call, item))
        call.pending = len(call.items)
        if not _submit_all(sim, call):
            return await _queue_full(sim, request, parsed)
        if parsed.stream:
            return await _stream(sim, request, call, drop=fault is Fault.DROP)
        await call.done
        await sim.wait_unstalled()
        if call.dropped:
            return _close(sim, request, "outage_dropped")
        if call.orphaned:
            return await _orphaned(sim, request, call)
        aborted = _injected_abort(call)
        if aborted is not None:
            return _abort_response(sim, aborted)
        outputs = [item.output(final=True) for item in call.items]
        payload = responses.dumps(outputs[0] if parsed.is_single else outputs)
        if fault is Fault.DROP:
            return await _send_partial(sim, request, payload)
        sim.stats.by_status["200"] += 1
        return web.Response(body=payload, content_type="application/json")
    finally:
        # A client that went away (handler cancelled) frees its slots, as SGLang aborts on disconnect.
        sim.calls.discard(call)
        unfinished = [item for item in call.items if not item.finished]
        for item in unfinished:
            sim.engine.cancel(item.req)
        for item in call.items:
            if sim.inflight.get(item.item.rid) is item:
                del sim.inflight[item.item.rid]


def _generation(sim: Simulator, item: GenerateItem) -> Generation:
    assert item.params is not None
    params = {
        "max_new_tokens": item.max_new_tokens,
        "stop_token_ids": sorted(item.params.stop_token_ids),
        "ignore_eos": item.params.ignore_eos,
        "sampling_seed": item.params.sampling_seed,
    }
    if sim.config.content.sample_per_request:  # each request its own draw (rids differ per attempt)
        params["sampling_seed"] = int.from_bytes(hashlib.blake2b(item.rid.encode(), digest_size=4).digest(), "little")
    return expected_generation(item.input_ids, params, sim.config.content)


def _call_item(sim: Simulator, call: Call, item: GenerateItem) -> CallItem:
    """The item's expected generation, or its NaN / injected-abort variant (``--nan-rate``/``--abort-rate``)."""
    generation = _generation(sim, item)
    config = sim.faults.config  # POST /control/faults may have changed the rates
    if config.bad_output_rate:
        where = sim.faults.choose_bad_output(_prompt_key(item.input_ids), item.rid)
        if where is not None:
            return _bad_output(sim, call, item, generation, where)
    if not (config.nan_rate or config.abort_rate):
        return CallItem(call, item, generation)
    key = item.rid if call.parsed.client_rids else str(hash(tuple(item.input_ids)))
    fault, where = sim.faults.choose_generation(key)
    n = len(generation.output_ids)
    if fault is GenerationFault.NAN and n >= 2:
        assert item.params is not None
        overwrite = nan_overwrite_id(
            list(item.raw_sampling_params.get("stop_token_ids") or []),
            sim.config.content.eos_token_ids,
            sim.config.server.vocab_size,
        )
        return CallItem(call, item, nan_generation(generation, int(where * (n - 1)), overwrite), nan=True)
    if fault is GenerationFault.ABORT:
        abort = sim.faults.abort
        ids = generation.output_ids[: int(where * n)]
        think_end = sim.config.content.think_end_id
        partial = Generation(ids, abort.finish_reason(), reasoning_token_count(ids, think_end), generation.tool_call)
        return CallItem(call, item, partial, abort=abort)
    return CallItem(call, item, generation)


def _prompt_key(input_ids: list[int]) -> str:
    """A prompt's identity across calls and processes (every attempt of it draws the same bad-output fault)."""
    return hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=16).hexdigest()


def _bad_output(sim: Simulator, call: Call, item: GenerateItem, generation: Generation, where: float) -> CallItem:
    """``--bad-output-rate``: the item's 200 answer carries what no generation can — an id of 2**31
    (``int32``) or of the vocabulary size (``vocab``) at a drawn position (never the stop id when there are
    two or more ids), or (``overlong``) a stop finish with ``max_new_tokens + 1`` ids."""
    kind = sim.faults.config.bad_output_kind
    ids = generation.output_ids
    if kind == "overlong":
        budget = max(1, int(item.max_new_tokens or len(ids) or 1))
        body = (ids[:budget] + [FILLER_ID] * budget)[:budget]
        stop = sim.config.content.eos_token_ids[0]
        padded = [*body, stop]
        finish = {"type": "stop", "matched": stop}
        think_end = sim.config.content.think_end_id
        bad = Generation(padded, finish, reasoning_token_count(padded, think_end), generation.tool_call)
        return CallItem(call, item, bad, bad_output=True)
    value = 2**31 if kind == "int32" else sim.config.server.vocab_size
    position = int(where * (len(ids) - 1)) if len(ids) > 1 else 0
    return CallItem(call, item, generation, bad_id=(position, value))


def _injected_abort(call: Call) -> Abort | None:
    """The first item the scheduler aborted with a status (``_handle_abort_finish_reason`` raises it)."""
    for item in call.items:
        if item.injected_abort is not None and item.req.abort_message is None:
            return item.injected_abort
    return None


def _abort_response(sim: Simulator, abort: Abort) -> web.Response:
    """A non-streamed call whose request the scheduler aborted: 400 → ValueError → ``{"error":{"message"}}``;
    500/503 → ``HTTPException`` → SGLang's ErrorResponse with that status (0.5.9 and 0.5.23 alike)."""
    if abort.status_code == 400:
        return _json(sim, errors.error_body(abort.message), 400)
    return _json(sim, errors.error_response_body(abort.message, abort.status_code), abort.status_code)


def _submit_all(sim: Simulator, call: Call) -> bool:
    """Register and submit every item; on a full queue undo them all and return False.

    A rid already registered (only possible without the duplicate check, e.g. 0.5.9) is taken over,
    as ``rid_to_state[rid] = state`` does: the earlier call holding it will never be answered.
    """
    for item in call.items:
        earlier = sim.inflight.get(item.item.rid)
        if earlier is not None:
            (earlier.call if isinstance(earlier, CallItem) else earlier).orphaned = True
            sim.stats.duplicate_rids.append(item.item.rid)
        sim.inflight[item.item.rid] = item
    for submitted, item in enumerate(call.items):
        try:
            sim.engine.submit(item.req)
        except QueueFullError:
            for earlier in call.items[:submitted]:
                sim.engine.cancel(earlier.req)
            for each in call.items:
                if sim.inflight.get(each.item.rid) is each:
                    del sim.inflight[each.item.rid]
                each.finished = True
            return False
    return True


def _fault_key(parsed: GenerateCall) -> str:
    """Per-call fault key: the client's rids, else the prompts (uuid rids would not be reproducible)."""
    if parsed.client_rids:
        return ",".join(item.rid for item in parsed.items)
    return ",".join(str(hash(tuple(item.input_ids))) for item in parsed.items)


async def _stream(sim: Simulator, request: web.Request, call: Call, drop: bool) -> web.StreamResponse:
    """SSE with cumulative ``text``/``output_ids``; ``finish_reason`` null until each item's last chunk."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    finished = 0
    while finished < len(call.items):
        event = await call.events.get()
        if event is DROPPED:
            return _close(sim, request, "outage_dropped", resp)
        kind, item = event
        final = kind == "finish"
        if not final and (item.finished or item.req.reported_tokens <= item.sent_tokens):
            continue  # superseded by a later event
        await sim.wait_unstalled()
        if call.orphaned:  # its rid was taken over: no more chunks, ever
            return await _orphaned(sim, request, call, resp)
        item.sent_tokens = item.req.reported_tokens
        await resp.write(responses.sse(item.output(final=final)))
        if drop and (final or 2 * item.req.reported_tokens >= item.req.output_len):
            return _close(sim, request, "drop", resp)
        finished += final
    await resp.write(responses.SSE_DONE)
    sim.stats.by_status["200"] += 1
    return resp


async def _bad_request(sim: Simulator, request: web.Request, stream: bool, message: str) -> web.StreamResponse:
    if not stream:
        return _json(sim, errors.error_body(message), 400)
    # SGLang validates inside the streaming generator: the 200 SSE response carries the error.
    sim.stats.by_status["200"] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = errors.stream_error_chunk(message, sim.profile.detailed_stream_errors)
    await resp.write(responses.sse(chunk) + responses.SSE_DONE)
    return resp


async def _internal_error(sim: Simulator, request: web.Request, stream: bool) -> web.StreamResponse:
    """An uncaught TypeError: FastAPI's plain-text 500, or (stream) 200 headers then a closed connection."""
    if not stream:
        sim.stats.by_status["500"] += 1
        return web.Response(status=500, text=errors.INTERNAL_ERROR_TEXT, content_type="text/plain")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return _close(sim, request, "500_stream", resp)


async def _orphaned(
    sim: Simulator, request: web.Request, call: Call, resp: web.StreamResponse | None = None
) -> web.StreamResponse:
    """A call whose rid another call took over: SGLang never answers it (until the client leaves)."""
    sim.stats.by_status["orphaned"] += 1
    await call.released.wait()  # only an outage or shutdown drops the connection
    return _close(sim, request, "outage_dropped", resp)


async def _queue_full(sim: Simulator, request: web.Request, parsed: GenerateCall) -> web.StreamResponse:
    """SGLang's queue-full abort: 503 ErrorResponse, or (streaming) an abort chunk then [DONE]."""
    if not parsed.stream:
        return _json(sim, errors.error_response_body(errors.QUEUE_FULL_MESSAGE, 503), 503)
    sim.stats.by_status["200"] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for item in parsed.items:
        chunk: dict[str, Any] = {
            "text": "",
            "output_ids": [],
            "meta_info": sim.meta_info(
                rid=item.rid,
                finish_reason=responses.abort_reason(errors.QUEUE_FULL_MESSAGE, status_code=503),
                prompt_tokens=len(item.input_ids),
                weight_version=sim.config.server.weight_version,
                reasoning_tokens=0,
                completion_tokens=0,
                cached_tokens=0,
            ),
        }
        if not parsed.is_single:
            chunk["index"] = item.index
        await resp.write(responses.sse(chunk))
    await resp.write(responses.SSE_DONE)
    return resp


async def _hang(sim: Simulator, request: web.Request, call: Call) -> web.StreamResponse:
    """Hold the rids and never answer; ends when the client disconnects (or an outage drops it)."""
    sim.stats.by_status["hang"] += 1
    held = [item.rid for item in call.parsed.items]
    for rid in held:
        sim.inflight[rid] = call
    try:
        await call.released.wait()  # only an outage (or shutdown) resolves it
        return _close(sim, request, "outage_dropped")
    finally:
        for rid in held:
            if sim.inflight.get(rid) is call:
                del sim.inflight[rid]


async def _send_partial(sim: Simulator, request: web.Request, payload: bytes) -> web.StreamResponse:
    """Headers and half the body, then the connection closes: the client sees a truncated payload."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(payload)
    await resp.prepare(request)
    await resp.write(payload[: max(1, len(payload) // 2)])
    return _close(sim, request, "drop", resp)


def _close(
    sim: Simulator, request: web.Request, kind: str, resp: web.StreamResponse | None = None
) -> web.StreamResponse:
    """Close the connection under the client (what a crashed or flaky server looks like)."""
    sim.stats.by_status[kind] += 1
    if kind == "outage_dropped":
        sim.faults.injected[kind] += 1
    if request.transport is not None:
        request.transport.close()
    # aiohttp's final write hits the closed connection and is discarded (ConnectionError is expected).
    return resp if resp is not None else web.Response(status=200)


def _json(sim: Simulator, body: Any, status: int) -> web.Response:
    sim.stats.by_status[str(status)] += 1
    return web.Response(body=responses.dumps(body), status=status, content_type="application/json")
