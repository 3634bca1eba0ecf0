"""The HTTP side: one aiohttp session per process, one /generate call per attempt.

aiohttp's defaults are traps here (reference: 100 connections per session, 300 s total timeout):
the connector is sized to the thread pool and the only timeout is a per-request deadline scaled to
``max_new_tokens``.

Health probes (:meth:`SGLangClient.probe_health`) tell "not ready yet" (connection refused while the
weights load, a prompt 503 while warming up) from a failure (no answer within the probe timeout — set
above the server's own ``SGLANG_HEALTH_CHECK_TIMEOUT``, so the server's verdict decides —, a 503 after
that wait, any other status).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from workers.sglang import (
    Generation,
    ServerFault,
    Unanswered,
    body_pieces,
    classify_http_error,
    parse_response,
)

if TYPE_CHECKING:
    from workers.sglang import ImagePrompt

log = logging.getLogger(__name__)

#: A 503 from /health_generate sooner than this is "warming up / shutting down" (SGLang answers those at
#: once); a later one is the server's own health-check timeout — a failure.
PROMPT_503_S = 5.0
#: Best effort: an /abort_request that gets no answer this soon is given up.
ABORT_TIMEOUT_S = 5.0
_JSON = {"Content-Type": "application/json"}


class _Pieces(aiohttp.payload.Payload):
    """A request body written piece by piece (workers/sglang.py ``body_pieces``), with its Content-Length."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(pieces, content_type="application/json")
        self._size = sum(len(p) for p in pieces)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        for piece in self._value:
            await writer.write(piece)


def decode_json(payload: bytes) -> Any:
    """A /generate body: orjson, else the stdlib (which also reads the ``NaN``/``Infinity`` literals orjson
    refuses and a server other than SGLang's ORJSONResponse may write)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(payload)
    except ValueError as exc:
        raise ServerFault(f"undecodable /generate body ({len(payload)} bytes)") from exc


@dataclass(frozen=True)
class Probe:
    """One /health_generate probe: ``state`` is ready | loading | warming | timeout | error."""

    state: str
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.state == "ready"

    @property
    def not_ready_yet(self) -> bool:
        """Loading (connection refused) or warming up (a prompt 503): expected while a server starts."""
        return self.state in ("loading", "warming")


class SGLangClient:
    def __init__(
        self,
        base_url: str,
        connections: int,
        connect_timeout_s: float,
        probe_timeout_s: float,
        health_probe_timeout_s: float | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._connections = connections
        self._connect_timeout_s = connect_timeout_s
        self._probe_timeout_s = probe_timeout_s  # /model_info, /server_info
        self.health_probe_timeout_s = health_probe_timeout_s or probe_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._aborts: set[asyncio.Task[None]] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=self._connections)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            # No cookie jar: SGLang sets no cookies, and filtering a jar is work on every request.
            jar = aiohttp.DummyCookieJar()
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=jar)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str,
        deadline_s: float,
        vocab_size: int | None = None,
        images: ImagePrompt | None = None,
    ) -> Generation:
        """One attempt. Raises ServerFault (BadOutput: an answer that cannot be stored, e.g. an output id
        outside ``[0, vocab_size)``) / PermanentError (an image prompt the server expanded otherwise than sent:
        ImageTokensMismatch) / asyncio.TimeoutError."""
        # orjson: the ids are most of the bytes both ways, and the stdlib json is several times slower on them.
        image_data = images.image_data if images is not None else None
        asked = images is not None and images.return_prompt_token_ids
        pieces = body_pieces(input_ids, sampling_params, rid, image_data, asked)
        body = pieces[0] if len(pieces) == 1 else _Pieces(pieces)  # an image prompt's images: not copied again
        try:
            async with asyncio.timeout(deadline_s):
                async with self.session.post(f"{self.base_url}/generate", data=body, headers=_JSON) as resp:
                    payload = await resp.read()
                    if resp.status != 200:
                        raise classify_http_error(resp.status, payload)
        except TimeoutError:
            # Free the server's slot without holding ours: a stalled server would not answer the abort either.
            task = asyncio.get_running_loop().create_task(self.abort(rid))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise Unanswered(f"no answer within the {deadline_s:.0f}s deadline (rid {rid})") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise Unanswered(f"{type(exc).__name__}: {exc}") from exc
        data = decode_json(payload)
        return parse_response(
            data,
            rid,
            sampling_params.get("max_new_tokens"),
            sampling_params.get("logprobs"),
            vocab_size=vocab_size,
            prompt_len=len(input_ids),
            expected=images.expected if images is not None else None,
        )

    async def abort(self, rid: str) -> None:
        """Free the server's slot of a request we gave up on (best effort)."""
        try:
            async with asyncio.timeout(min(self._probe_timeout_s, ABORT_TIMEOUT_S)):
                async with self.session.post(f"{self.base_url}/abort_request", json={"rid": rid}) as resp:
                    await resp.read()
        except Exception as exc:
            log.debug("abort_request %s failed: %s", rid, exc)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with asyncio.timeout(self._probe_timeout_s):
            async with self.session.get(f"{self.base_url}{path}") as resp:
                return resp.status, await resp.read()

    async def healthy(self) -> bool:
        return (await self.probe_health()).ok

    async def probe_health(self, timeout_s: float | None = None) -> Probe:
        """One ``/health_generate`` (a real 1-token generation: ≥ 1 s on a real server, longer under load)."""
        timeout = timeout_s or self.health_probe_timeout_s
        started = time.monotonic()

        def probe(state: str, detail: str) -> Probe:
            return Probe(state, detail, time.monotonic() - started)

        try:
            async with asyncio.timeout(timeout):
                async with self.session.get(f"{self.base_url}/health_generate") as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            return probe("timeout", f"no answer to /health_generate within {timeout:g}s")
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, ConnectionRefusedError) or "refused" in str(exc).lower():
                return probe("loading", "connection refused (loading weights, or restarting)")
            return probe("error", f"{type(exc).__name__}: {exc}")
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            return probe("error", f"{type(exc).__name__}: {exc}")
        if status == 200:
            return probe("ready", "200")
        elapsed = time.monotonic() - started
        if status == 503 and elapsed < PROMPT_503_S:
            return probe("warming", "503 (warming up or shutting down)")
        if status == 503:
            return probe("error", f"503 after {elapsed:.0f}s (the server's own health check timed out)")
        return probe("error", f"HTTP {status} from /health_generate")

    async def get_json(self, path: str) -> Any:
        status, body = await self.get(path)
        if status != 200:
            raise ServerFault(f"GET {path} → {status}")
        return json.loads(body)
