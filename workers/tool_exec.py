"""Live tool results (``tool_results: executor``): the job's executor called for a step's tool calls, at most once.

The executor is the user's: a Python callable (``module:function`` or ``path/to/file.py:function``, async or sync)
or an HTTP endpoint (``http(s)://…``, POSTed JSON), named by the job (``--tool-executor``). It receives
``{"job", "conversation", "turn", "step", "calls": [{"id", "name", "arguments"}]}`` — arguments as decoded from the
native tool-call tokens, ``id`` a *stable* call id (``{step prompt id}@r{revision}:{calls digest}#{i}``: the same for
every attempt of that step revision that makes these calls, another for other calls) — and returns one result per
call (a list of strings or ``{"content": …}`` objects).

A worker runs only executors it is told to trust (``THINKFLEET_TOOL_EXECUTORS`` / ``worker --tool-executors``,
comma-separated specs; "*" = any): the spec comes from the job record in Redis, and importing a module named there
would run whatever code a Redis writer chose.

At most once, per step revision *and calls*: a record in ``Keys.tool_calls`` is keyed by the step revision and the
digest of the decoded calls it answers (:func:`record_field`), so results are only ever fed back to the calls they
answer. A run marks the record ``pending`` before it calls the executor and records the outcome over its mark after
(before its part is written and its finalize enqueues the next step), both through one Lua check-and-set that
also checks the run's claim (thinkfleet/state/lua/tool_calls.lua): a fenced run — paused past its lease, its step
taken over — neither calls nor records (:class:`ToolFenced`; its row is refused at mark_part). A later attempt with
the same calls — the orphan recovery of a worker killed after the record, a redelivery, a regenerated step that
drew the same calls — reuses the recorded results without calling again; a regenerated step whose answer makes
*other* calls (a kill after the record, before the part write, and the model sampled anew) has its own record and
runs its tools once. One that finds only another run's ``pending`` mark for its calls cannot know whether the call
happened and ends the chain (``tool_error``) rather than call twice. An error or timeout is retried
(``executor_retries`` more times, inside the one mark), then ends the chain with its reason (``chain_end:
tool_error``, counted as ``tool_errors``); so does a result JSON cannot hold (:func:`json_results`: recorded as the
error, not retried). The outcome is kept in memory until Redis took its record: a commit retried after a Redis error
records it rather than calling again.
Calls run with their own timeout and bounded concurrency. Timeout, retries and concurrency are the worker's settings
(``THINKFLEET_TOOL_TIMEOUT_S``, ``_RETRIES``, ``_CONCURRENCY``; ``worker --tool-timeout-s …``): how hard a host
may drive a tool is the host's call, like its in-flight bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from thinkfleet.failpoints import failpoint
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import Fence, Ledger

#: The environment variable that lists the executors a worker runs (the ``tool_executors`` setting).
TRUSTED_ENV = "THINKFLEET_TOOL_EXECUTORS"
#: The settings' defaults (one source: thinkfleet/settings.py), for an executor built without settings.
DEFAULT_TIMEOUT_S: float = Settings.model_fields["tool_timeout_s"].default
DEFAULT_RETRIES: int = Settings.model_fields["tool_retries"].default
DEFAULT_CONCURRENCY: int = Settings.model_fields["tool_concurrency"].default
PENDING = "pending"

log = logging.getLogger("thinkfleet.worker")


class ToolExecError(Exception):
    """The executor failed (after its retries), timed out, or its outcome is unknown."""


class ToolFenced(Exception):
    """This run's claim is not current (another run took the step over): it calls and records nothing, and its
    row is fenced at mark_part."""


def stable_call_id(step_prompt_id: str, revision: int, digest: str, index: int) -> str:
    """Call ``index`` of the step revision's calls whose :func:`calls_digest` is ``digest``."""
    return f"{step_prompt_id}@r{revision}:{digest}#{index}"


def trusted(spec: str, allowed_specs: str | None = None) -> bool:
    """``spec`` is in ``allowed_specs`` (comma-separated; None: the ``THINKFLEET_TOOL_EXECUTORS`` environment)."""
    listed = os.environ.get(TRUSTED_ENV, "") if allowed_specs is None else allowed_specs
    allowed = [s.strip() for s in listed.split(",") if s.strip()]
    return "*" in allowed or spec in allowed


def load_callable(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function``."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ToolExecError(f"executor {spec!r}: give module:function, path/to/file.py:function or an http(s) URL")
    if target.endswith(".py"):
        path = Path(target)
        module_spec = importlib.util.spec_from_file_location(f"thinkfleet_executor_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ToolExecError(f"executor {spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ToolExecError(f"executor {spec!r}: {name} is not a function of {target}")
    return fn


class ToolExecutor:
    """One job's executor with its limits (the worker keeps one per job)."""

    def __init__(
        self,
        spec: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        concurrency: int = DEFAULT_CONCURRENCY,
        allowed_specs: str | None = None,
    ) -> None:
        if not trusted(spec, allowed_specs):
            raise ToolExecError(
                f"executor {spec!r} is not one this worker runs (add it to {TRUSTED_ENV} or worker --tool-executors)"
            )
        self.spec, self.timeout_s, self.retries = spec, timeout_s, retries
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self._fn = None if spec.startswith(("http://", "https://")) else load_callable(spec)
        #: field → an outcome this process got from the executor and has not recorded yet (its record raised).
        self.unrecorded: dict[str, dict[str, Any]] = {}

    @classmethod
    def for_worker(cls, spec: str, settings: Settings) -> ToolExecutor:
        """The executor ``spec`` with this worker's trust list and limits (its ``tool_*`` settings)."""
        return cls(
            spec, settings.tool_timeout_s, settings.tool_retries, settings.tool_concurrency, settings.tool_executors
        )

    async def _once(self, request: dict[str, Any]) -> list[Any]:
        if self._fn is None:
            import aiohttp

            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session, session.post(self.spec, json=request) as r:
                r.raise_for_status()
                out = await r.json()
        elif inspect.iscoroutinefunction(self._fn):
            out = await asyncio.wait_for(self._fn(request), self.timeout_s)
        else:
            out = await asyncio.wait_for(asyncio.to_thread(self._fn, request), self.timeout_s)
        results = out.get("results") if isinstance(out, dict) else out
        if not isinstance(results, list) or len(results) != len(request["calls"]):
            raise ToolExecError(f"executor {self.spec!r} returned {out!r:.200}, not one result per call")
        return results

    async def run(self, request: dict[str, Any]) -> list[Any]:
        """The results, retried on error or timeout; ToolExecError after the last try."""
        last: Exception | None = None
        async with self._sem:
            for _ in range(1 + max(0, self.retries)):
                try:
                    return await self._once(request)
                except (TimeoutError, Exception) as exc:  # the user's code: any error is its failure
                    last = exc
        raise ToolExecError(f"executor {self.spec!r} failed: {type(last).__name__}: {last}")


def json_results(spec: str, results: list[Any]) -> list[Any]:
    """``results`` when JSON can hold them (strict: no NaN, which Redis' cjson refuses), else ToolExecError: the
    chain ends ``tool_error`` at once — never a record that raises on every retry of the commit, nor a second
    call of the executor for the same calls."""
    try:
        json.dumps(results, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise ToolExecError(f"executor {spec!r} returned a result that is not JSON: {why}") from exc
    return results


def calls_digest(calls: Sequence[dict[str, Any]]) -> str:
    """The identity of a run's decoded calls (names and arguments, in order): what a record answers."""
    return hashlib.sha256(json.dumps([c.get("function") for c in calls], sort_keys=True).encode()).hexdigest()[:16]


def record_field(step_prompt_id: str, revision: int, digest: str) -> str:
    """The ``Keys.tool_calls`` field of one step revision's calls (:func:`calls_digest`)."""
    return f"{step_prompt_id}@{revision}:{digest}"


async def executed_results(
    ledger: Ledger,
    executor: ToolExecutor,
    job: str,
    step_prompt_id: str,
    revision: int,
    where: dict[str, Any],
    calls: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The ``tool`` messages for ``calls`` of this step revision: recorded ones, else the executor's, recorded
    first (see the module docstring). ``where``: {conversation, turn, step}. ToolFenced: this run's claim is not
    current (nothing called or recorded)."""
    digest = calls_digest(calls)
    field = record_field(step_prompt_id, revision, digest)
    own = {"calls": digest, "epoch": (ledger.fence(job, step_prompt_id) or Fence()).epoch, "worker": ledger.worker}
    state, found = await ledger.tool_call(job, step_prompt_id, "mark", field, json.dumps({PENDING: True, **own}))
    if state == "fenced":
        raise ToolFenced(f"{step_prompt_id}: its claim is held by {found}: the executor is not called")
    record = json.loads(found) if state == "recorded" else {PENDING: True}
    kept = executor.unrecorded.get(field)
    if state == "marked" or (_own(record, own) and kept is not None and kept.get("epoch") == own["epoch"]):
        request = {
            "job": job,
            **where,
            "calls": [
                {
                    "id": stable_call_id(step_prompt_id, revision, digest, i),
                    "name": (c.get("function") or {}).get("name", ""),
                    "arguments": (c.get("function") or {}).get("arguments", ""),
                }
                for i, c in enumerate(calls)
            ],
        }
        record = await _call_and_record(ledger, executor, job, step_prompt_id, field, own, request)
    if "error" in record:
        raise ToolExecError(str(record["error"]))
    if "results" not in record:
        raise ToolExecError(f"{step_prompt_id}: an earlier attempt's executor call has no recorded outcome")
    if record.get("calls") != digest:  # the field names the digest: only a foreign write gets here
        raise ToolExecError(f"{step_prompt_id}: the recorded results answer other calls")
    return [
        {
            "role": "tool",
            "tool_call_id": call.get("id") or f"call_{i}",
            "content": r.get("content", "") if isinstance(r, dict) else str(r),
            "source": "executed",
        }
        for i, (call, r) in enumerate(zip(calls, record["results"], strict=True))
    ]


def _own(record: dict[str, Any], own: dict[str, Any]) -> bool:
    """``record`` is this run's own pending mark (its outcome not recorded: a Redis error after the call)."""
    return bool(record.get(PENDING)) and (record.get("epoch"), record.get("worker")) == (own["epoch"], own["worker"])


async def _call_and_record(
    ledger: Ledger,
    executor: ToolExecutor,
    job: str,
    step_prompt_id: str,
    field: str,
    own: dict[str, Any],
    request: dict[str, Any],
) -> dict[str, Any]:
    """Call the executor once for this run (an outcome it kept from a failed record is recorded again instead),
    then record the outcome over our pending mark while our claim is current."""
    outcome = executor.unrecorded.get(field)
    if outcome is None or outcome.get("epoch") != own["epoch"]:
        try:
            outcome = {"results": json_results(executor.spec, await executor.run(request)), **own}
        except ToolExecError as exc:
            outcome = {"error": str(exc), **own}
        failpoint("after_tool_call", step_prompt_id)
        # Kept until Redis answers the record: a commit retried after a Redis error records it, not a second call.
        executor.unrecorded[field] = outcome
    state, found = await ledger.tool_call(job, step_prompt_id, "record", field, json.dumps(outcome, ensure_ascii=False))
    executor.unrecorded.pop(field, None)
    if state == "fenced":
        log.warning("fenced: %s/%s lost its claim (now %s) during its executor call: not recorded", job, field, found)
        raise ToolFenced(f"{step_prompt_id}: its claim is held by {found}: the executor's outcome is not recorded")
    if state != "recorded":
        raise ToolExecError(f"{step_prompt_id}: another run's record holds these calls: {found[:200]}")
    failpoint("after_tool_record", step_prompt_id)
    return outcome
