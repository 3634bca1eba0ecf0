"""The simulated server's state: its clock (:class:`SimClock`), the :class:`Simulator` every route reads, and the
/generate calls in flight (:class:`Call`, one per HTTP call, and its :class:`CallItem` per prompt).

The routes stand on this module (sglang_sim/server.py, sglang_sim/generate.py); it imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

from sglang_sim import responses
from sglang_sim.config import SimConfig
from sglang_sim.content import Generation, expected_logprobs, reasoning_token_count
from sglang_sim.engine import Engine, SimRequest
from sglang_sim.faults import Abort, FaultInjector
from sglang_sim.metrics import CallStats, SimMetrics
from sglang_sim.request import GenerateCall, GenerateItem, Limits
from sglang_sim.speculative import figures
from sglang_sim.text import TextCodec
from sglang_sim.versions import VersionProfile
from sglang_sim.vision import SimVision

logger = logging.getLogger("sglang_sim")

#: What a dropped call's event queue yields: the connection closes without an answer.
DROPPED = object()


#: Retraction counts kept per rid for ``meta_info`` (the oldest are forgotten beyond this many).
RETRACTED_RIDS_KEPT = 50_000


class SimClock:
    """Simulated seconds since start: wall time × ``time_scale``, minus the time the process was overloaded.

    When the event loop wakes the scheduler tick later than ``max_tick_lag_s``, the simulator's own
    process could not keep up (a busy CPU, not a slow client): the excess lag is not charged as
    simulated time, so a saturated simulator slows its clock instead of showing an idle GPU.
    """

    def __init__(self, time_scale: float, max_tick_lag_s: float | None) -> None:
        self.time_scale = time_scale
        self.max_tick_lag_s = max_tick_lag_s
        self.paused_wall_s = 0.0
        self._t0 = time.monotonic()
        self._last_s = 0.0
        self._frozen_at: float | None = None

    def now_s(self) -> float:
        wall = time.monotonic() if self._frozen_at is None else self._frozen_at
        now = (wall - self._t0 - self.paused_wall_s) * self.time_scale
        self._last_s = max(self._last_s, now)  # never backwards, even right after a pause is booked
        return self._last_s

    def freeze(self) -> None:
        """Stop simulated time (a stalled server makes no progress) until :meth:`thaw`."""
        if self._frozen_at is None:
            self._frozen_at = time.monotonic()

    def thaw(self) -> None:
        if self._frozen_at is not None:
            self.paused_wall_s += time.monotonic() - self._frozen_at
            self._frozen_at = None

    def note_tick_lag(self, lag_s: float) -> None:
        if self.max_tick_lag_s is not None and lag_s > self.max_tick_lag_s:
            self.paused_wall_s += lag_s - self.max_tick_lag_s


class Simulator:
    """Everything one simulated server holds; created per app (several may share a process)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        server = config.server
        self.profile: VersionProfile = server.profile
        lag_s = None if server.max_tick_lag_ms is None else server.max_tick_lag_ms / 1000.0
        self.clock = SimClock(server.time_scale, lag_s)
        self.engine = Engine(config.engine, self.clock.now_s)
        self.engine.on_retract = self._on_retract
        #: rid → times the scheduler retracted it (``meta_info``'s retraction count; only retracted rids).
        self.retracted: OrderedDict[str, int] = OrderedDict()
        self.codec = TextCodec(server.tokenizer)
        #: The model's image processor (sglang_sim/vision.py); None: a text-only model, image_data is ignored.
        self.vision = SimVision.load(server.tokenizer, self.codec.tokenizer, self.profile.image_errors_400)
        self.faults = FaultInjector(config.faults)
        self.metrics = SimMetrics(server.model_name)
        self.stats = CallStats()
        self.limits = Limits(
            server.context_length,
            server.vocab_size,
            server.max_req_input_len,
            context_check_inclusive=self.profile.context_check_inclusive,
            type_error_500=not self.profile.sampling_contract,
        )
        #: rid → the item (or hanging call) holding it; SGLang's ``rid_to_state``.
        self.inflight: dict[str, CallItem | Call] = {}
        self.calls: set[Call] = set()
        self.created_unix_s = int(time.time())
        self.startup_time = time.time()
        #: Extra seconds every health answer takes (``POST /control/health_delay``).
        self.health_delay_s = server.health_delay_s
        #: The last health check timed out (ServerStatus.UnHealthy) until one passes again.
        self.unhealthy = False
        self.shutting_down = False
        self._listening_at = time.monotonic()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._ticker: asyncio.Task[None] | None = None
        #: Speculative decoding's totals (verify steps, tokens they emitted): ``avg_spec_accept_length``.
        self.spec_steps = self.spec_tokens = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """The port is open now (the CLI binds after ``load_s``): warm-up starts."""
        self._listening_at = time.monotonic()
        self.startup_time = time.time()
        self._ticker = asyncio.create_task(self._tick_loop(), name="sglang-sim-ticker")

    async def stop(self) -> None:
        self.shutting_down = True
        self.end_stall()
        for call in list(self.calls):
            call.drop()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    def warming(self) -> bool:
        """``ServerStatus.Starting``: the warm-up after the port opened has not finished."""
        return time.monotonic() - self._listening_at < self.config.server.warmup_s

    def ready(self) -> bool:
        """``TokenizerManager.is_ready()``: up, not unhealthy, not shutting down."""
        return not (self.warming() or self.unhealthy or self.shutting_down or self.faults.in_outage())

    async def _tick_loop(self) -> None:
        """The scheduler loop: one task advances every request (no per-request sleeps)."""
        tick_s = self.config.server.tick_ms / 1000.0
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + tick_s
            await asyncio.sleep(tick_s)
            self.clock.note_tick_lag(loop.time() - due)
            if self.faults.scheduled_outage_due():
                self.begin_outage(self.config.faults.outage_duration_s, mode="drop")
            try:
                self.engine.advance()
            except Exception:  # a bug here must not silently freeze every request
                logger.exception("engine tick failed")

    # -- stall --------------------------------------------------------------------------------------
    @property
    def stalled(self) -> bool:
        return not self._unstalled.is_set()

    def begin_stall(self, seconds: float) -> None:
        """Answer nothing and freeze generation for ``seconds`` wall seconds (0 ends a stall)."""
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if seconds <= 0:
            self.end_stall()
            return
        logger.warning("stall for %.1f s", seconds)
        self.stats.stalls += 1
        self.clock.freeze()
        self._unstalled.clear()
        self._stall_timer = asyncio.get_running_loop().call_later(seconds, self.end_stall)

    def end_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self.stalled:
            logger.warning("stall over")
        self.clock.thaw()
        self._unstalled.set()

    async def wait_unstalled(self) -> None:
        """Return at once, or when a stall ends (every answer the server sends passes here)."""
        while not self._unstalled.is_set():
            await self._unstalled.wait()

    # -- events -------------------------------------------------------------------------------------
    def record_rids(self, parsed: GenerateCall) -> None:
        self.stats.generate_items += len(parsed.items)
        self.stats.rids.update(item.rid for item in parsed.items)

    def on_item_finished(self, item: CallItem) -> None:
        req = item.req
        aborted = req.abort_message is not None or item.injected_abort is not None
        if aborted:
            self.stats.aborted += 1
        else:
            self.stats.completed += 1
        if req.abort_message is None:
            if item.injected_abort is not None:
                self.stats.abort_rids.append(item.item.rid)
            elif item.nan:
                self.stats.nan_rids.append(item.item.rid)
            elif item.bad_output:
                self.stats.bad_output_rids.append(item.item.rid)
        if self.inflight.get(item.item.rid) is item:
            del self.inflight[item.item.rid]  # SGLang drops rid_to_state on finish
        self.metrics.observe_finish(
            req.prompt_tokens, req.cached_tokens, req.generated_tokens, req.e2e_latency_s, aborted
        )

    def begin_outage(self, duration_s: float, mode: str = "drop") -> None:
        """The server goes down: in-flight calls are dropped (or aborted), new ones get 503."""
        if duration_s <= 0:
            self.faults.end_outage()
            return
        logger.warning("outage for %.1f s (mode %s)", duration_s, mode)
        self.faults.start_outage(duration_s)
        for call in list(self.calls):
            if mode == "drop" or not call.items:  # a hanging call has no engine work to abort
                call.drop()
        self.engine.abort(abort_all=True)

    def _on_retract(self, req: SimRequest) -> None:
        self.retracted[req.rid] = req.retractions
        self.retracted.move_to_end(req.rid)
        while len(self.retracted) > RETRACTED_RIDS_KEPT:
            self.retracted.popitem(last=False)
        self.metrics.observe_retraction(req.prompt_tokens, req.resumed_tokens)

    def spec_meta_info(self, output_ids: list[int]) -> dict[str, Any] | None:
        """A finished request's acceptance figures under ``--speculative-algorithm`` (None without it)."""
        server = self.config.server
        if server.speculative_algorithm is None or server.speculative_num_draft_tokens is None:
            return None
        spec = figures(output_ids, server.speculative_num_draft_tokens, server.speculative_accept_rate)
        self.spec_steps += spec.verify_ct
        self.spec_tokens += spec.accepted + spec.verify_ct
        return spec.meta_info(self.profile.spec_keys)

    def meta_info(self, **fields: Any) -> dict[str, Any]:
        """``responses.meta_info`` with this release's keys (and the rid's retraction count)."""
        meta = responses.meta_info(
            **fields,
            retractions_key=self.profile.retractions_key,
            with_reasoning_tokens=self.profile.reasoning_tokens,
            with_cached_tokens_details=self.profile.cached_tokens_details,
            timing=self.profile.timing_meta_info and self.config.server.enable_metrics,
            layout=self.profile.meta_info_layout,
        )
        retractions = self.retracted.get(fields.get("rid", ""), 0)
        if retractions and self.profile.retractions_key in meta:
            meta[self.profile.retractions_key] = retractions
        return meta


# -- routes ------------------------------------------------------------------------------------------


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
        self.req.output_ids = generation.output_ids  # cached with the prompt when it finishes
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
                finish = responses.abort_reason(req.abort_message or "", waiting=req.aborted_while_waiting)
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
                spec=sim.spec_meta_info(ids) if final else None,
            ),
        }
        if self.item.return_logprob:
            out["meta_info"] = self._with_logprobs(out["meta_info"], ids)
        if self.call.parsed.return_prompt_token_ids and sim.profile.prompt_token_ids:
            out["prompt_token_ids"] = self.item.input_ids  # expanded for an image prompt (sglang_sim/vision.py)
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
        self.events.put_nowait(DROPPED)
        self.released.set()
        if not self.done.done():
            self.done.set_result(None)
