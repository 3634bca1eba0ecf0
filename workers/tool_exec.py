"""Live tool results (``tool_results: executor``): the job's executor called for a step's tool calls, at most once.

The executor is the user's: a Python callable (``module:function`` or ``path/to/file.py:function``, async or sync)
or an HTTP endpoint (``http(s)://…``, POSTed JSON), named by the job (``--tool-executor``). It receives
``{"job", "conversation", "turn", "step", "calls": [{"id", "name", "arguments"}]}`` — arguments as decoded from the
native tool-call tokens, ``id`` a *stable* call id (``{step prompt id}@r{revision}#{i}``: the same for every attempt
of that step revision) — and returns one result per call (a list of strings or ``{"content": …}`` objects).

A worker runs only executors it is told to trust (``THINKFLEET_TOOL_EXECUTORS`` / ``worker --tool-executors``,
comma-separated specs; "*" = any): the spec comes from the job record in Redis, and importing a module named there
would run whatever code a Redis writer chose.

Exactly once, per step revision: the call is marked ``pending`` in ``Keys.tool_calls`` (HSETNX: one caller wins)
before it runs and its results are written there (before the step's finalize enqueues the next step). A later
attempt — the orphan recovery of a worker killed after the call, a redelivery — finds the results and reuses them
without calling again; one that finds only the ``pending`` mark cannot know whether the call happened and ends the
chain (``tool_error``) rather than call twice. An error or timeout is retried (``executor_retries`` more times,
inside the one mark), then ends the chain with its reason (``chain_end: tool_error``, counted as ``tool_errors``).
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
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from thinkfleet.failpoints import failpoint
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings

#: The environment variable that lists the executors a worker runs (the ``tool_executors`` setting).
TRUSTED_ENV = "THINKFLEET_TOOL_EXECUTORS"
#: The settings' defaults (one source: thinkfleet/settings.py), for an executor built without settings.
DEFAULT_TIMEOUT_S: float = Settings.model_fields["tool_timeout_s"].default
DEFAULT_RETRIES: int = Settings.model_fields["tool_retries"].default
DEFAULT_CONCURRENCY: int = Settings.model_fields["tool_concurrency"].default
PENDING = "pending"


class ToolExecError(Exception):
    """The executor failed (after its retries), timed out, or its outcome is unknown."""


def stable_call_id(step_prompt_id: str, revision: int, index: int) -> str:
    return f"{step_prompt_id}@r{revision}#{index}"


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


async def executed_results(
    client: aioredis.Redis,
    keys: Keys,
    executor: ToolExecutor,
    job: str,
    step_prompt_id: str,
    revision: int,
    where: dict[str, Any],
    calls: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The ``tool`` messages for ``calls`` of this step revision: recorded ones, else the executor's, recorded
    first (see the module docstring). ``where``: {conversation, turn, step}."""
    key, field = keys.tool_calls(job), f"{step_prompt_id}@{revision}"
    # The calls the record answers: another generation of this step revision (its first row never committed, the
    # prompt run again) may call otherwise, and must not be answered with these results.
    digest = hashlib.sha256(json.dumps([c.get("function") for c in calls], sort_keys=True).encode()).hexdigest()[:16]
    recorded = await client.hget(key, field)
    if recorded is None and await client.hsetnx(key, field, json.dumps({PENDING: True, "calls": digest})):
        request = {
            "job": job,
            **where,
            "calls": [
                {
                    "id": stable_call_id(step_prompt_id, revision, i),
                    "name": (c.get("function") or {}).get("name", ""),
                    "arguments": (c.get("function") or {}).get("arguments", ""),
                }
                for i, c in enumerate(calls)
            ],
        }
        try:
            results = await executor.run(request)
        except ToolExecError as exc:
            await client.hset(key, field, json.dumps({"error": str(exc), "calls": digest}))
            raise
        failpoint("after_tool_call", step_prompt_id)
        await client.hset(key, field, json.dumps({"results": results, "calls": digest}, ensure_ascii=False))
        failpoint("after_tool_record", step_prompt_id)
        recorded = await client.hget(key, field)
    record = json.loads(recorded) if recorded is not None else {PENDING: True}
    if "error" in record:
        raise ToolExecError(str(record["error"]))
    if "results" not in record:
        raise ToolExecError(f"{step_prompt_id}: an earlier attempt's executor call has no recorded outcome")
    if record.get("calls") != digest:
        raise ToolExecError(f"{step_prompt_id}: the recorded results answer other calls (an earlier generation's)")
    return [
        {
            "role": "tool",
            "tool_call_id": call.get("id") or f"call_{i}",
            "content": r.get("content", "") if isinstance(r, dict) else str(r),
            "source": "executed",
        }
        for i, (call, r) in enumerate(zip(calls, record["results"], strict=True))
    ]
