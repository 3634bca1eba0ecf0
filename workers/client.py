"""The HTTP side: one aiohttp session per process, one /generate call per attempt.

aiohttp's defaults are traps here (reference: 100 connections per session, 300 s total timeout):
the connector is sized to the thread pool and the only timeout is a per-request deadline scaled to
``max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from workers.sglang import (
    Generation,
    ServerFault,
    build_request,
    classify_http_error,
    parse_response,
)

log = logging.getLogger(__name__)


class SGLangClient:
    def __init__(self, base_url: str, connections: int, connect_timeout_s: float, probe_timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self._connections = connections
        self._connect_timeout_s = connect_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=self._connections)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, deadline_s: float
    ) -> Generation:
        """One attempt. Raises ServerFault / PermanentError / asyncio.TimeoutError."""
        body = build_request(input_ids, sampling_params, rid)
        try:
            async with asyncio.timeout(deadline_s):
                async with self.session.post(f"{self.base_url}/generate", json=body) as resp:
                    payload = await resp.read()
                    if resp.status != 200:
                        raise classify_http_error(resp.status, payload)
        except TimeoutError:
            await self.abort(rid)
            raise ServerFault(f"no answer within the {deadline_s:.0f}s deadline (rid {rid})") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise ServerFault(f"{type(exc).__name__}: {exc}") from exc
        try:
            data = json.loads(payload)
        except ValueError as exc:
            raise ServerFault(f"undecodable /generate body ({len(payload)} bytes)") from exc
        return parse_response(data, rid, sampling_params.get("max_new_tokens"))

    async def abort(self, rid: str) -> None:
        """Free the server's slot of a request we gave up on (best effort)."""
        try:
            async with asyncio.timeout(self._probe_timeout_s):
                async with self.session.post(f"{self.base_url}/abort_request", json={"rid": rid}) as resp:
                    await resp.read()
        except Exception as exc:
            log.debug("abort_request %s failed: %s", rid, exc)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with asyncio.timeout(self._probe_timeout_s):
            async with self.session.get(f"{self.base_url}{path}") as resp:
                return resp.status, await resp.read()

    async def healthy(self) -> bool:
        try:
            status, _ = await self.get("/health_generate")
            return status == 200
        except (TimeoutError, aiohttp.ClientError, ConnectionError, OSError):
            return False

    async def get_json(self, path: str) -> Any:
        status, body = await self.get(path)
        if status != 200:
            raise ServerFault(f"GET {path} → {status}")
        return json.loads(body)
