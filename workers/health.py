"""Server health gate: no prompt is consumed while the local SGLang server is unhealthy.

Preflight runs at start and after every recovery: ``/health_generate`` (a real 1-token generation),
``/model_info`` (model path, weight_version, …) and ``/server_info`` (effective max running requests,
reasoning parser, version, deterministic inference, …). Transitions call ``on_down``/``on_up``, which
stop and resume consuming the queue. A prompt about to be dead-lettered for its length has the info read
once more first (:meth:`HealthGate.refresh_info`): a server restarted with a longer context inside one
health interval never closed the gate, so nothing else would read it again.

Probes fit the real server (docs/sglang-versions.md, ``/health``):

- A probe waits up to ``health_probe_timeout_s`` (70 s: above compose's ``SGLANG_HEALTH_CHECK_TIMEOUT``
  of 60 s, so the server's own verdict decides). A real probe takes ≥ 1 s, more under load.
- A slow or failed probe alone never closes the gate while generations complete: the worker notes every
  completed ``/generate`` (:meth:`HealthGate.note_completion`), and a probe that fails after a
  generation completed during it is excused (counted, logged, the gate stays open).
- Connection refused (weights loading) and a prompt 503 before the server first served (warming up) are
  *not ready yet*: their own log line and ``thinkfleet_server_state`` value (``loading`` / ``warming``),
  not failures. A prompt 503 from a server that was serving (shutting down, an outage) is ``unhealthy``.
- While closed, the gate probes every second or so and also reopens as soon as a generation completes,
  so a gate closed by a stall reopens as soon as the server answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from workers.client import Probe, SGLangClient
from workers.sglang import ServerInfo, parse_server_info

log = logging.getLogger(__name__)

#: ``thinkfleet_server_state`` (workers/metrics.py) is one of unknown, ready, loading, warming, unhealthy
#: (a probe failed while no generation completed, or a 503 from a server that was serving).
#: Longest wait between probes while the gate is closed.
CLOSED_INTERVAL_S = 1.0
#: Seconds between two "probe failed but generations complete" log lines.
EXCUSE_LOG_EVERY_S = 60.0
#: While the gate stays closed its state is logged again after 5 s, then at doubling intervals up to 60 s.
FIRST_REMINDER_S = 5.0
MAX_REMINDER_S = 60.0
#: A prompt refused under info read less than this long ago is not worth another read (a burst of prompts too
#: long for the server would otherwise read it once each).
REREAD_MIN_AGE_S = 1.0


class HealthGate:
    def __init__(
        self,
        client: SGLangClient,
        interval_s: float,
        max_inflight: int,
        on_down: Callable[[], None] = lambda: None,
        on_up: Callable[[], None] = lambda: None,
        metrics: Any = None,
        closed_interval_s: float | None = None,
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.closed_interval_s = min(interval_s, closed_interval_s or CLOSED_INTERVAL_S)
        self.max_inflight = max_inflight
        self.on_down = on_down
        self.on_up = on_up
        self.metrics = metrics  # workers.metrics.WorkerMetrics (optional in tests)
        self.info: ServerInfo | None = None
        #: Every server configuration this gate has read, by its digest (``ServerInfo.config_digest``): a row
        #: generated before a restart that changed the server's arguments still finds what served it
        #: (workers/provenance.py records it).
        self.known: dict[str, ServerInfo] = {}
        self.state = "unknown"
        self.detail = ""
        self.last_completion = float("-inf")  # monotonic time of the last completed /generate
        self.last_probe: Probe | None = None
        self._healthy = asyncio.Event()
        self._probe_now = asyncio.Event()
        self._completed = asyncio.Event()  # set by a completion while the gate is closed
        self._news = asyncio.Event()  # pulsed after every probe verdict and state change
        self._task: asyncio.Task[None] | None = None
        self._excused_logged = float("-inf")
        self._waiters = 0
        self._was_ready = False  # served since it last refused connections (then a 503 is not a warm-up)
        self._closed_since = self._logged_at = 0.0
        self._remind_after = FIRST_REMINDER_S
        self._info_reads = 0  # reads of /model_info + /server_info started (successful or not)
        self._info_at = float("-inf")  # monotonic time the info held now was read (its read's start)
        self._refresh = asyncio.Lock()  # one refresh_info read at a time; its waiters share it

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    # -- what the worker tells the gate ------------------------------------------------------------
    def note_completion(self) -> None:
        """A /generate call completed (the server answers): probes failing meanwhile are excused."""
        self.last_completion = time.monotonic()
        if not self.healthy:
            self._completed.set()
        if self._waiters:
            self._pulse()

    def alive_since(self, t: float) -> bool:
        """A generation completed at or after monotonic time ``t``."""
        return self.last_completion >= t

    def report_failure(self) -> None:
        """A request failed in a way that may mean the server is down: probe now."""
        self._probe_now.set()

    async def wait_news(self, timeout_s: float) -> None:
        """Until the next probe verdict or completed generation (or ``timeout_s``): what a failed request
        during which nothing else completed waits for before its retry, so a server that is down or stalled
        doesn't burn the prompt's retries (if the verdict closes the gate, the prompt is handed back)."""
        news = self._news
        self._probe_now.set()
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout_s):
                await news.wait()
        except TimeoutError:
            pass
        finally:
            self._waiters -= 1

    def wake_waiters(self) -> None:
        """End every :meth:`wait_news` now (a drain: their prompts go back to the queue)."""
        self._pulse()

    async def wait_healthy(self, timeout_s: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._healthy.wait()
            return True
        except TimeoutError:
            return False

    # -- preflight ---------------------------------------------------------------------------------
    async def preflight(self) -> ServerInfo | None:
        probe = await self.client.probe_health()
        self._count_probe(probe)
        if not probe.ok:
            return None
        return await self._read_info()

    async def refresh_info(self, seen: ServerInfo | None) -> ServerInfo | None:
        """The server's info read again for a prompt refused under ``seen`` (what the gate held then).

        The gate reads /model_info, /server_info and /v1/models only when it (re)opens, so a server restarted
        with a longer context inside one health interval leaves it with the old context length; a prompt about
        to be dead-lettered for its length asks for one more read first. Reads are shared: when the gate's info
        is no longer ``seen`` (another read replaced it) it is returned as it is, callers that waited on a read
        in flight take its result, and info read less than :data:`REREAD_MIN_AGE_S` ago is not read again.
        Returns the gate's info afterwards (``seen`` itself when nothing newer was read)."""
        if self.info is not seen:
            return self.info
        reads = self._info_reads
        async with self._refresh:
            recent = seen is not None and time.monotonic() - self._info_at < REREAD_MIN_AGE_S
            if self._info_reads == reads and self.info is seen and not recent:
                log.info("re-reading the server's info (a prompt is refused for its length under what was read)")
                await self._read_info()
        return self.info

    async def _read_info(self) -> ServerInfo | None:
        self._info_reads += 1
        started = time.monotonic()
        try:
            model_info = await self.client.get_json("/model_info")
            server_info = await self.client.get_json("/server_info")
        except Exception as exc:
            log.warning("preflight: server answered health but not model/server info: %s", exc)
            return None
        try:
            models = await self.client.get_json("/v1/models")  # max_model_len: the effective context length
        except Exception as exc:
            log.info("preflight: no /v1/models (%s): context length from /server_info only", exc)
            models = None
        info = parse_server_info(model_info, server_info, models if isinstance(models, dict) else None)
        effective = info.effective_max_running_requests
        if effective is not None and self.max_inflight > effective:
            log.warning(
                "THINKFLEET_MAX_INFLIGHT=%d exceeds the server's effective max running requests (%d): "
                "the excess waits in SGLang's queue; lower it or raise --max-running-requests",
                self.max_inflight,
                effective,
            )
        log.info(
            "preflight ok: model=%s weight_version=%s sglang=%s reasoning_parser=%s max_running=%s "
            "vocab_size=%s context_length=%s deterministic_inference=%s speculative=%s server_config=%s",
            info.model_path,
            info.weight_version,
            info.version or "?",
            info.reasoning_parser,
            effective,
            info.vocab_size if info.vocab_size is not None else "unreported",
            info.context_length if info.context_length is not None else "unreported",
            {True: "on", False: "off", None: "unreported"}[info.deterministic],
            info.launch_args.get("speculative_algorithm") or "off",
            info.config_digest,
        )
        if info.config_digest is not None:
            self.known[info.config_digest] = info
        self.info, self._info_at = info, started
        return info

    # -- the monitor -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._monitor(), name="health-gate")

    async def _monitor(self) -> None:
        while True:
            self._probe_now.clear()  # a failure reported while this round probes asks for the next one
            try:
                await self.check()
            except Exception:  # a bug here must not leave the gate frozen in either state
                log.exception("health check failed")
            interval = self.interval_s if self.healthy else self.closed_interval_s
            wake = [asyncio.ensure_future(self._probe_now.wait())]
            if not self.healthy:
                wake.append(asyncio.ensure_future(self._completed.wait()))
            try:
                await asyncio.wait(wake, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in wake:
                    w.cancel()

    async def check(self) -> None:
        """One round: probe, then open or close the gate on the verdict (waiters hear of it either way)."""
        try:
            await self._check()
        finally:
            self._pulse()

    async def _check(self) -> None:
        started = time.monotonic()
        was_open = self.healthy
        probe = await (self.client.probe_health() if was_open else self._probe_while_closed())
        self._count_probe(probe)
        if probe.ok:
            if not was_open and await self._read_info() is None:
                self._close("unhealthy", "health answered but /model_info or /server_info did not")
            else:
                self._open()
        elif was_open and probe.state in ("timeout", "error") and self.alive_since(started):
            # Generations completed while this probe failed: the server works (a slow health check under
            # load, say). The probe alone never closes the gate. (Refused or a prompt 503 — loading,
            # warming, shutting down — is the server's own word: the gate closes.)
            if self.metrics is not None:
                self.metrics.probes_excused.inc()
            now = time.monotonic()
            if now - self._excused_logged >= EXCUSE_LOG_EVERY_S:
                self._excused_logged = now
                log.info(
                    "health probe %s (%s) while generations complete: keeping the gate open",
                    probe.state,
                    probe.detail,
                )
        elif probe.state == "warming" and self._was_ready:
            # A prompt 503 from a server that was serving: shutting down or unavailable, not warming up.
            self._close("unhealthy", "503 from /health_generate (shutting down or unavailable)")
        else:
            self._close("unhealthy" if probe.state in ("timeout", "error") else probe.state, probe.detail)

    async def _probe_while_closed(self) -> Probe:
        """A probe that a completed generation cuts short: the server answers again, so reopen now."""
        self._completed.clear()
        probe_task = asyncio.ensure_future(self.client.probe_health())
        completed = asyncio.ensure_future(self._completed.wait())
        try:
            await asyncio.wait({probe_task, completed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            completed.cancel()
        if probe_task.done():
            return probe_task.result()
        probe_task.cancel()
        return Probe("ready", "a /generate call completed", 0.0)

    def _count_probe(self, probe: Probe) -> None:
        self.last_probe = probe
        if self.metrics is not None:
            self.metrics.probes.labels(probe.state).inc()
            self.metrics.probe_seconds.observe(probe.seconds)

    def _open(self) -> None:
        self._was_ready = True
        self._set_state("ready", "")
        if not self._healthy.is_set():
            self._healthy.set()
            log.info("SGLang at %s is healthy: consuming", self.client.base_url)
            self.on_up()

    def _close(self, state: str, detail: str) -> None:
        was_open = self._healthy.is_set()
        first = self.state == "unknown"
        changed = self._set_state(state, detail)
        if state == "loading":
            self._was_ready = False  # a (re)starting server: its next 503s are its warm-up
        self._healthy.clear()
        url = self.client.base_url
        now = time.monotonic()
        if changed:
            self._closed_since = self._logged_at = now
            self._remind_after = FIRST_REMINDER_S
        elif now - self._logged_at >= self._remind_after:  # still closed: say so now and then
            self._logged_at = now
            self._remind_after = min(2 * self._remind_after, MAX_REMINDER_S)
        else:
            url = ""
        if url:
            still = "" if changed else f" (for {now - self._closed_since:.0f}s)"
            if state == "loading":
                log.info("SGLang at %s is not ready yet%s: %s; waiting (not consuming)", url, still, detail)
            elif state == "warming":
                log.info("SGLang at %s is not ready yet%s: warming up, %s; waiting (not consuming)", url, still, detail)
            else:
                log.warning("SGLang at %s is unhealthy%s (%s): handing work back, not consuming", url, still, detail)
        if was_open or first:
            self.on_down()

    def _set_state(self, state: str, detail: str) -> bool:
        changed = state != self.state
        self.state, self.detail = state, detail
        if changed and self.metrics is not None:
            self.metrics.server_state.state(state)
        return changed

    def _pulse(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
