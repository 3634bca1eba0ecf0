"""One prompt's /generate attempts against the local SGLang server: the in-flight bound and the retries.

:class:`RequestAttempts` owns what every request of the process shares — the ``max_inflight`` semaphore
(around the HTTP call only, so a finished request frees its slot at once while its row waits for the
group commit), the record of requests in flight (request → job, rid) that a drain or a job's cancel
aborts — and the retry policy: a server fault is retried with jittered backoff up to
``retry_max_attempts``, after waiting for the health gate's news when nothing completed while the
attempt ran (the fault may be the whole server's) — except for a fault the server *answered* (a NaN stop, a
:class:`~workers.sglang.BadOutput`: an id outside the vocabulary, counts that disagree), which says the server
is up. Every answer is validated (workers/sglang.py ``parse_response``, against the vocabulary) before its
row can join a commit group. It raises :class:`~workers.sglang.PermanentError` (dead-letter) or
:class:`HandBack` (draining, server down); everything else is the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from thinkfleet.failpoints import failpoint
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.state.job import DEFAULT_MAX_NEW_TOKENS
from thinkfleet.state.lifecycle import CANCELLED_CLASS
from workers.adaptive import ResizableLimiter
from workers.client import SGLangClient
from workers.health import HealthGate
from workers.metrics import WorkerMetrics
from workers.sglang import Generation, PermanentError, ServerFault

if TYPE_CHECKING:
    from workers.sglang import ImagePrompt

log = logging.getLogger("thinkfleet.worker")


class HandBack(Exception):
    """Give the message back to the queue (server down, draining, storage failure, a crash)."""


class RequestAttempts:
    def __init__(
        self,
        settings: Settings,
        client: SGLangClient,
        gate: HealthGate,
        metrics: WorkerMetrics,
        draining: Callable[[], bool],
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.gate = gate
        self.metrics = metrics
        self._draining = draining
        self._on_idle = on_idle  # nothing in flight any more (the queue ran dry): commit the last rows now
        # The in-flight bound: max_inflight, or (inflight_mode auto) what workers/adaptive.py resizes it to.
        self.semaphore = ResizableLimiter(settings.max_inflight)
        #: Requests in flight: request → (job, rid); a drain or a job's cancel cancels them.
        self.inflight: dict[asyncio.Future[Any], tuple[str, str]] = {}
        #: Jobs seen cancelled (producer cancel): no further attempt is sent for them.
        self.cancelled_jobs: set[str] = set()

    def _closed(self) -> bool:
        return self._draining() or not self.gate.healthy

    def cancel_all(self) -> None:
        """Drain past its grace: every request in flight is cancelled (its prompt is handed back)."""
        for request in list(self.inflight):
            request.cancel()

    async def run(
        self,
        task: PromptTask,
        input_ids: list[int],
        sampling: dict[str, Any],
        vocab_size: int | None = None,
        images: ImagePrompt | None = None,
    ) -> tuple[Generation, int, float]:
        """The generation, the attempts it took and the last attempt's latency (s). ``vocab_size`` (the
        server's, else the job record's; None: unknown) bounds every output id of an answer; ``images``: an
        image prompt's ``image_data`` and the expanded prompt its answer must show."""
        s = self.settings
        deadline = s.request_deadline_s(int(sampling.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS))
        attempt = 0
        seen = self.gate.info  # the server's limits the prompt was checked against (workers/pipeline.py)
        reread = False
        while True:
            if task.job in self.cancelled_jobs:
                raise PermanentError(CANCELLED_CLASS, "job cancelled (producer cancel) before this attempt")
            if self._closed():
                raise HandBack()
            async with self.semaphore:
                if self._closed():
                    raise HandBack()
                attempt += 1
                gen, error, started, sent_at = await self._attempt(
                    task, input_ids, sampling, attempt, deadline, vocab_size, images
                )
            if error is None:
                self.gate.note_completion()
                self.metrics.note_retractions(getattr(gen, "num_retractions", None))  # workers/adaptive.py
                return gen, attempt, time.perf_counter() - started  # type: ignore[return-value]
            if isinstance(error, PermanentError):
                # The server refused the prompt's length (its own 400): it may have restarted with another
                # context since the gate read it. Read it once more; only a longer context earns another try.
                if reread or not await self._context_grew(seen):
                    raise error
                reread = True
                log.warning("retrying %s: the server's context grew since it refused it: %s", task.prompt_id, error)
                continue
            await self._before_retry(task, error, attempt, sent_at)

    async def _context_grew(self, seen: Any) -> bool:
        """Whether the server's context (or input cap), read again, is longer than under ``seen``."""
        fresh = await self.gate.refresh_info(seen)
        if fresh is None or fresh is seen:
            return False
        for field in ("context_length", "max_req_input_len"):
            new, old = getattr(fresh, field, None), getattr(seen, field, None) if seen is not None else None
            if new is not None and (old is None or new > old):
                return True
        return False

    async def _attempt(
        self,
        task: PromptTask,
        input_ids: list[int],
        sampling: dict[str, Any],
        attempt: int,
        deadline: float,
        vocab_size: int | None = None,
        images: ImagePrompt | None = None,
    ) -> tuple[Generation | None, ServerFault | PermanentError | None, float, float]:
        """One /generate call inside a request slot: (generation, None) or (None, the server's fault, or its
        context-length refusal)."""
        rid = f"{task.task_id}/a{attempt}-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        sent_at = time.monotonic()
        self.metrics.request_started()
        extra = {"images": images} if images is not None else {}  # a text prompt's call is as it always was
        request = asyncio.ensure_future(self.client.generate(input_ids, sampling, rid, deadline, vocab_size, **extra))
        self.inflight[request] = (task.job, rid)
        try:
            failpoint("during_generate", task.prompt_id)
            return await request, None, started, sent_at
        except asyncio.CancelledError:
            if self._draining():
                await self.client.abort(rid)
                raise HandBack() from None
            if task.job in self.cancelled_jobs and request.cancelled():
                await self.client.abort(rid)  # the job was cancelled (the runtime's cancel watch)
                raise PermanentError(CANCELLED_CLASS, "job cancelled while generating") from None
            raise
        except ServerFault as exc:
            if exc.answered:
                self.gate.note_completion()  # a bad sample or a bad answer, but the server answers
            return None, exc, started, sent_at
        except PermanentError as exc:
            if exc.error_class == "context_overflow" and exc.status is not None:
                return None, exc, started, sent_at  # the server's refusal of its length: run() re-reads once
            raise
        except BaseException:
            request.cancel()  # our own failure: don't leave the request running unowned
            raise
        finally:
            self.inflight.pop(request, None)
            self.metrics.request_finished(time.perf_counter() - started)
            if not self.inflight:
                self._on_idle()

    async def _before_retry(self, task: PromptTask, error: ServerFault, attempt: int, sent_at: float) -> None:
        """Count the fault, give up past ``retry_max_attempts``, else wait out the backoff (and the gate)."""
        s = self.settings
        self.metrics.retried.labels(error.error_class).inc()
        if not error.answered:
            self.gate.report_failure()
        if attempt >= s.retry_max_attempts:
            error_class = error.exhausted_class or f"retries_exhausted:{error.error_class}"
            exhausted = PermanentError(error_class, str(error), answer=getattr(error, "answer", None))
            exhausted.attempts = attempt  # type: ignore[attr-defined]
            raise exhausted
        if error.answered:
            log.warning("%s for %s (attempt %d), retrying: %s", error.error_class, task.prompt_id, attempt, error)
        if not error.answered and not self.gate.alive_since(sent_at):
            # No generation completed while this attempt ran: the fault may be the whole server's (an
            # outage, a stall), not this prompt's. Wait for the next completion or probe verdict
            # instead of spending retries on it; if the gate closes, the prompt is handed back.
            await self.gate.wait_news(s.health_probe_timeout_s + s.health_interval_s)
            if self._closed():
                raise HandBack()
        backoff = random.uniform(0, min(s.retry_max_backoff_s, s.retry_base_s * 2 ** (attempt - 1)))
        log.info("retrying %s (attempt %d) in %.2fs: %s", task.prompt_id, attempt, backoff, error)
        await asyncio.sleep(backoff)
