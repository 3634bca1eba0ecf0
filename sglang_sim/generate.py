"""``POST/PUT /generate``: parse, validate, inject faults, run through the engine, answer (JSON or SSE).

What differs between releases (``--sglang-version``) is read from ``sim.profile``
(:class:`sglang_sim.versions.VersionProfile`): the sampling-params contract check, duplicate rids, the
context boundary, meta_info keys, the streamed error chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sglang_sim import protocol
from sglang_sim.content import (
    Generation,
    expected_generation,
    expected_logprobs,
    nan_generation,
    nan_overwrite_id,
    reasoning_token_count,
)
from sglang_sim.engine import QueueFullError, SimRequest
from sglang_sim.faults import Abort, Fault, GenerationFault

if TYPE_CHECKING:
    from sglang_sim.protocol import GenerateCall, GenerateItem
    from sglang_sim.server import Simulator

#: Where an app keeps its Simulator.
SIM_KEY: web.AppKey[Simulator] = web.AppKey("sglang_sim")
#: Message of the 503 /generate answers during an outage.
OUTAGE_MESSAGE = "Service Unavailable: the server is down (sglang-sim outage)."
#: Message of the 503 /generate answers during warm-up with ``--warmup-rejects-generate``.
WARMUP_MESSAGE = "Service Unavailable: the server is warming up (sglang-sim --warmup-rejects-generate)."
_DROP = object()
#: The id an ``overlong`` bad output pads with (an ordinary filler id of every family).
FILLER_ID = 100


class CallItem:
    """One prompt of an HTTP call while it runs: its expected output and its engine request."""

    def __init__(
        self,
        call: Call,
        item: GenerateItem,
        generation: Generation,
        nan: bool = False,
        abort: Abort | None = None,
        bad_id: tuple[int, int] | None = None,
        bad_output: bool = False,
    ) -> None:
        self.call = call
        self.item = item
        #: What this item reports once finished (a NaN or injected-abort variant of the expected one).
        self.generation = generation
        #: The generation took SGLang's NaN path (``--nan-rate``).
        self.nan = nan
        #: The scheduler aborts it after ``len(generation.output_ids)`` tokens (``--abort-rate``).
        self.injected_abort = abort
        #: ``--bad-output-rate``: the answer is bad (``bad_id``: (position, id) written into the final
        #: output_ids in place of the sampled one; the text stays the sampled ids').
        self.bad_output = bad_output or bad_id is not None
        self.bad_id = bad_id
        self.req = SimRequest(
            item.rid,
            item.input_ids,
            len(generation.output_ids),
            on_finish=self._on_finish,
            on_progress=self._on_progress if call.parsed.stream else None,
        )
        self.finished = False
        self.sent_tokens = -1  # tokens in the last streamed chunk
        self._logprobs: tuple[list[float], list[list[tuple[float, int]]] | None] | None = None

    def _on_finish(self, req: SimRequest) -> None:
        self.finished = True
        self.call.sim.on_item_finished(self)
        self.call.item_finished(self)

    def _on_progress(self, req: SimRequest, tokens: int) -> None:
        self.call.events.put_nowait(("progress", self))

    def output(self, final: bool) -> dict[str, Any]:
        """The response dict for this item now (cumulative ids; ``finish_reason`` once final)."""
        sim, req, params = self.call.sim, self.req, self.item.params
        assert params is not None
        finish: dict[str, Any] | None = None
        if final and req.abort_message is None:
            ids, finish = self.generation.output_ids, self.generation.finish_reason
        else:
            count = req.generated_tokens if final else req.reported_tokens
            ids = self.generation.output_ids[:count]
            if final:
                finish = protocol.abort_reason(req.abort_message or "", waiting=req.aborted_while_waiting)
        text = sim.codec.decode(ids, finish, params.skip_special_tokens, params.no_stop_trim)
        if final and req.abort_message is None and self.bad_id is not None and ids:
            position, bad = self.bad_id
            ids = [*ids[:position], bad, *ids[position + 1 :]]
        out: dict[str, Any] = {
            "text": text,
            "output_ids": ids,
            "meta_info": sim.meta_info(
                rid=self.item.rid,
                finish_reason=finish,
                prompt_tokens=req.prompt_tokens,
                weight_version=sim.config.server.weight_version,
                reasoning_tokens=reasoning_token_count(ids, sim.config.content.think_end_id)
                if self.call.parsed.require_reasoning
                else 0,
                completion_tokens=len(ids),
                cached_tokens=req.cached_tokens,
                e2e_latency_s=req.e2e_latency_s if final else None,
                sent_ts=time.time() if final else None,
                in_batch=not self.call.parsed.is_single,
            ),
        }
        if self.item.return_logprob:
            out["meta_info"] = self._with_logprobs(out["meta_info"], ids)
        if self.call.parsed.return_prompt_token_ids:
            out["prompt_token_ids"] = self.item.input_ids
        if not self.call.parsed.is_single and self.call.parsed.stream:
            out["index"] = self.item.index
        return out

    def _with_logprobs(self, meta: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """``meta`` with the logprob keys where ``_handle_batch_output`` puts them (before
        ``completion_tokens``), as ``convert_logprob_style`` shapes them: triples ``[logprob, id, text|null]``.
        ``logprob_start_len`` -1 → one input position (the last prompt id, logprob null); 0.5.23: none (its
        scheduler starts at ``len(input_ids)``), plus ``output_token_logprobs_length``, before ``reasoning_tokens``."""
        item, sim = self.item, self.call.sim
        k = item.top_logprobs_num
        if self._logprobs is None:
            assert item.params is not None
            self._logprobs = expected_logprobs(
                item.input_ids, item.params.sampling_seed, self.generation.output_ids, k, sim.config.server.vocab_size
            )
        chosen, top = self._logprobs
        text = self.call.parsed.return_text_in_logprobs and sim.codec.has_tokenizer

        def triple(value: float | None, token: int) -> list[Any]:
            return [value, token, sim.codec.decode([token], None, False, True) if text else None]

        v0523 = sim.profile.meta_info_layout == "0.5.23"
        with_input = bool(item.input_ids) and not v0523
        keys: dict[str, Any] = {
            "input_token_logprobs": [triple(None, item.input_ids[-1])] if with_input else [],
            "output_token_logprobs": [triple(v, t) for v, t in zip(chosen, ids, strict=False)],
        }
        if v0523:
            keys["output_token_logprobs_length"] = len(keys["output_token_logprobs"])
        if k > 0:
            assert top is not None
            keys["input_top_logprobs"] = [None] if with_input else []
            keys["output_top_logprobs"] = [[triple(v, t) for v, t in alts] for alts in top[: len(ids)]]
        out: dict[str, Any] = {}
        for key, value in meta.items():
            if key == ("reasoning_tokens" if v0523 else "completion_tokens"):
                out.update(keys)
            out[key] = value
        return out


class Call:
    """One HTTP /generate call in flight (registered so an outage can drop its connection)."""

    def __init__(self, sim: Simulator, parsed: GenerateCall) -> None:
        self.sim = sim
        self.parsed = parsed
        self.items: list[CallItem] = []
        self.pending = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.dropped = False
        #: Another call took over one of its rids (no duplicate check): it is never answered.
        self.orphaned = False
        self.released = asyncio.Event()  # set when the connection is dropped (outage, shutdown)

    def item_finished(self, item: CallItem) -> None:
        self.pending -= 1
        if self.parsed.stream:
            self.events.put_nowait(("finish", item))
        if self.pending <= 0 and not self.done.done():
            self.done.set_result(None)

    def drop(self) -> None:
        """Close the connection without an answer (the server died)."""
        self.dropped = True
        self.events.put_nowait(_DROP)
        self.released.set()
        if not self.done.done():
            self.done.set_result(None)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    profile = sim.profile
    sim.stats.generate_calls += 1
    if sim.faults.in_outage():
        sim.faults.injected["outage_503"] += 1
        return _json(sim, protocol.error_response_body(OUTAGE_MESSAGE, 503), 503)
    if sim.config.server.warmup_rejects_generate and sim.warming():
        return _json(sim, protocol.error_response_body(WARMUP_MESSAGE, 503), 503)

    try:
        body = protocol.parse_body(await request.read())
    except protocol.InvalidBody as exc:
        return _json(sim, exc.body, 400)
    if profile.sampling_contract:
        contract_error = protocol.contract_error(body.sampling_params)
        if contract_error is not None:  # before the stream starts: a plain 400 even for stream=true
            return _json(sim, {"error": contract_error}, 400)
    try:
        parsed = protocol.normalize_call(body, sim.codec.encode, profile.rejects_duplicate_rids)
    except ValueError as exc:
        return await _bad_request(sim, request, body.stream, str(exc))
    sim.record_rids(parsed)
    try:
        for item in parsed.items:
            protocol.validate_item(item, sim.limits, sim.codec.has_tokenizer)
        if profile.rejects_duplicate_rids:
            for item in parsed.items:
                if item.rid in sim.inflight:
                    raise protocol.BadRequest(f"Duplicate request ID detected: {item.rid}")
    except protocol.BadRequest as exc:
        return await _bad_request(sim, request, parsed.stream, str(exc))
    except protocol.InternalError:
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
        payload = protocol.dumps(outputs[0] if parsed.is_single else outputs)
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
        return _json(sim, protocol.error_body(abort.message), 400)
    return _json(sim, protocol.error_response_body(abort.message, abort.status_code), abort.status_code)


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
        if event is _DROP:
            return _close(sim, request, "outage_dropped", resp)
        kind, item = event
        final = kind == "finish"
        if not final and (item.finished or item.req.reported_tokens <= item.sent_tokens):
            continue  # superseded by a later event
        await sim.wait_unstalled()
        if call.orphaned:  # its rid was taken over: no more chunks, ever
            return await _orphaned(sim, request, call, resp)
        item.sent_tokens = item.req.reported_tokens
        await resp.write(protocol.sse(item.output(final=final)))
        if drop and (final or 2 * item.req.reported_tokens >= item.req.output_len):
            return _close(sim, request, "drop", resp)
        finished += final
    await resp.write(protocol.SSE_DONE)
    sim.stats.by_status["200"] += 1
    return resp


async def _bad_request(sim: Simulator, request: web.Request, stream: bool, message: str) -> web.StreamResponse:
    if not stream:
        return _json(sim, protocol.error_body(message), 400)
    # SGLang validates inside the streaming generator: the 200 SSE response carries the error.
    sim.stats.by_status["200"] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = protocol.stream_error_chunk(message, sim.profile.detailed_stream_errors)
    await resp.write(protocol.sse(chunk) + protocol.SSE_DONE)
    return resp


async def _internal_error(sim: Simulator, request: web.Request, stream: bool) -> web.StreamResponse:
    """An uncaught TypeError: FastAPI's plain-text 500, or (stream) 200 headers then a closed connection."""
    if not stream:
        sim.stats.by_status["500"] += 1
        return web.Response(status=500, text=protocol.INTERNAL_ERROR_TEXT, content_type="text/plain")
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
        return _json(sim, protocol.error_response_body(protocol.QUEUE_FULL_MESSAGE, 503), 503)
    sim.stats.by_status["200"] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for item in parsed.items:
        chunk: dict[str, Any] = {
            "text": "",
            "output_ids": [],
            "meta_info": sim.meta_info(
                rid=item.rid,
                finish_reason=protocol.abort_reason(protocol.QUEUE_FULL_MESSAGE, status_code=503),
                prompt_tokens=len(item.input_ids),
                weight_version=sim.config.server.weight_version,
                reasoning_tokens=0,
                completion_tokens=0,
                cached_tokens=0,
            ),
        }
        if not parsed.is_single:
            chunk["index"] = item.index
        await resp.write(protocol.sse(chunk))
    await resp.write(protocol.SSE_DONE)
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
    return web.Response(body=protocol.dumps(body), status=status, content_type="application/json")
