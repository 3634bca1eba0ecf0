"""Server health gate: no prompt is consumed while the local SGLang server is unhealthy.

Preflight runs at start and after every recovery: ``/health_generate`` (a real 1-token generation),
``/model_info`` (model path, weight_version) and ``/server_info`` (effective max running requests,
reasoning parser). Transitions call ``on_down``/``on_up``, which stop and resume consuming the queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from workers.client import SGLangClient
from workers.sglang import ServerInfo, parse_server_info

log = logging.getLogger(__name__)


class HealthGate:
    def __init__(
        self,
        client: SGLangClient,
        interval_s: float,
        max_inflight: int,
        on_down: Callable[[], None] = lambda: None,
        on_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.max_inflight = max_inflight
        self.on_down = on_down
        self.on_up = on_up
        self.info: ServerInfo | None = None
        self._healthy = asyncio.Event()
        self._probe_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._state: bool | None = None  # unknown until the first probe

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    async def preflight(self) -> ServerInfo | None:
        if not await self.client.healthy():
            return None
        try:
            info = parse_server_info(
                await self.client.get_json("/model_info"), await self.client.get_json("/server_info")
            )
        except Exception as exc:
            log.warning("preflight: server answered health but not model/server info: %s", exc)
            return None
        effective = info.effective_max_running_requests
        if effective is not None and self.max_inflight > effective:
            log.warning(
                "THINKFLEET_MAX_INFLIGHT=%d exceeds the server's effective max running requests (%d): "
                "the excess waits in SGLang's queue; lower it or raise --max-running-requests",
                self.max_inflight,
                effective,
            )
        log.info(
            "preflight ok: model=%s weight_version=%s reasoning_parser=%s max_running=%s",
            info.model_path,
            info.weight_version,
            info.reasoning_parser,
            effective,
        )
        self.info = info
        return info

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._monitor(), name="health-gate")

    def report_failure(self) -> None:
        """A request failed in a way that may mean the server is down: probe now."""
        self._probe_now.set()

    async def wait_healthy(self, timeout_s: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._healthy.wait()
            return True
        except TimeoutError:
            return False

    async def _monitor(self) -> None:
        while True:
            ok = (await self.preflight() is not None) if not self.healthy else await self.client.healthy()
            if ok and self._state is not True:
                self._state = True
                self._healthy.set()
                log.info("SGLang at %s is healthy: consuming", self.client.base_url)
                self.on_up()
            elif not ok and self._state is not False:
                self._state = False
                self._healthy.clear()
                log.warning("SGLang at %s is unhealthy: handing work back, not consuming", self.client.base_url)
                self.on_down()
            self._probe_now.clear()
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._probe_now.wait()
            except TimeoutError:
                pass

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
