"""The worker's side of an agentic job (``tool_results`` set): what a stored step's finalize records and enqueues.

Entered from :meth:`workers.turns.TurnChainer._next` through :class:`StepChainer` (the chainer a worker runs: this
module builds on workers/turns.py, never the other way) for a job whose ``turns`` record says ``tool_results``
(:mod:`thinkfleet.tool_steps` holds the rules). It returns the same :class:`workers.turns.NextTurn` a plain turn
does, so the next step rides in the step's own finalize (thinkfleet/state/lua/finalize.lua, unchanged): exactly
once, and an orphan recovery computes the same next step from the stored row and the answer records before it.

- The model's answer calls tools (its calls complete: a call cut by ``max_new_tokens`` ends the chain,
  ``tool_call_cut``; ``producer retry --truncated`` re-runs it): the recorded results are replayed
  (:func:`thinkfleet.tool_steps.replay_results`) and step j+1 of the same turn is enqueued, its prompt the
  template's rendering of the conversation with the results after the calls; ``max_tool_steps`` steps at most.
- It calls none: the turn ends and turn i+1 follows, as for a plain turn.

The step's answer record carries ``next`` (what it enqueued), ``tool_results``, ``tool_mismatch`` and
``args_differ``; the history of a step is the walk from ``t0`` along ``next``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from thinkfleet.tool_steps import (
    DEFAULT_MAX_TOOL_STEPS,
    END_CUT,
    END_MAX_STEPS,
    END_MISMATCH,
    END_TOOL_ERROR,
    for_render,
    replay_results,
    step_messages,
)
from thinkfleet.turns import answers_key, split_step_id, step_id, turn_id
from workers.tool_exec import ToolExecError, ToolFenced
from workers.turns import TOOL_ARGS_DIFFER, NextTurn, TurnChainer, TurnError, _answer, _JobTurns

log = logging.getLogger(__name__)

#: Steps a history walk follows at most (a record cycle would otherwise never end).
MAX_WALK = 10_000


async def next_step(
    chainer: TurnChainer, jt: _JobTurns, job: str, dataset: str, row: dict[str, Any], conv: dict[str, Any]
) -> NextTurn:
    """What the finalize of agentic step ``row`` records and enqueues (see the module docstring)."""
    pid = row["prompt_id"]
    parts = split_step_id(pid)
    assert parts is not None
    conv_id, turn, step = parts
    meta = jt.meta
    answer = _answer(jt, row)
    revision = int(row.get("revision") or 0)
    recorded: dict[str, Any] = {**answer, "revision": revision} if revision else dict(answer)
    count = int(conv["turn_count"])
    calls = answer.get("tool_calls") or []
    old = await chainer.r.hget(answers_key(chainer.keys, job), pid)
    later = await _later(chainer, job, old)  # what an earlier revision of this step derived

    def end(reason: str) -> NextTurn:
        return NextTurn(pid, chainer._sign_answer(job, pid, {**recorded, "chain_end": reason}), drop=later)

    next_id = ""
    if calls:
        if _cut(jt, row):
            return end(END_CUT)
        if step + 1 >= int(meta.get("max_tool_steps") or DEFAULT_MAX_TOOL_STEPS):
            return end(END_MAX_STEPS)
    if meta.get("tool_results") == "executor":
        if calls:
            try:
                recorded["tool_results"] = await _execute(
                    chainer, job, pid, revision, (conv_id, turn, step), calls, meta, jt.record.generation
                )
            except ToolFenced as exc:
                # Another run holds the step now: ours calls nothing, records nothing, and mark_part refuses its row
                # (the fence is dropped) — nor does its finalize write an answer if it ever got there.
                log.warning("fenced: %s/%s: %s", job, pid, exc)
                return NextTurn(pid, "")
            except ToolExecError as exc:
                # (counted by the finalize that stores this end, once: chains_ended:tool_error. A count here ran
                # again whenever the commit group was replayed — another row's worker killed, a commit retried.)
                recorded["tool_error"] = str(exc)
                return end(END_TOOL_ERROR)
            next_id = step_id(conv_id, turn, step + 1)
        elif turn + 1 < count:
            next_id = turn_id(conv_id, turn + 1)
        return await _enqueue(chainer, jt, job, dataset, row, conv, recorded, next_id, later)
    replay = replay_results(conv, turn, step, calls, str(meta.get("tool_mismatch") or "chain_end"))
    if replay.mismatch:
        recorded["tool_mismatch"] = replay.mismatch
    if replay.args_differ is not None:
        recorded["args_differ"] = replay.args_differ
        row[TOOL_ARGS_DIFFER] = replay.args_differ
    if replay.ends_chain:
        return end(END_MISMATCH)
    if replay.results is not None:
        recorded["tool_results"] = replay.results
        next_id = step_id(conv_id, turn, step + 1)
    elif turn + 1 < count:
        next_id = turn_id(conv_id, turn + 1)
    return await _enqueue(chainer, jt, job, dataset, row, conv, recorded, next_id, later)


async def _enqueue(
    chainer: TurnChainer,
    jt: _JobTurns,
    job: str,
    dataset: str,
    row: dict[str, Any],
    conv: dict[str, Any],
    recorded: dict[str, Any],
    next_id: str,
    later: tuple[str, ...],
) -> NextTurn:
    """The finalize's writes for a step that goes on to ``next_id`` ("" = the conversation is complete)."""
    pid = row["prompt_id"]
    conv_id = (split_step_id(pid) or ("",))[0]
    if not next_id:  # the last turn's answer: the conversation is complete
        return NextTurn(pid, chainer._sign_answer(job, pid, recorded), drop=later)
    recorded["next"] = next_id
    history = await _history(chainer, job, conv_id, pid)
    messages = for_render(step_messages(conv, [*history, recorded]))
    following = await chainer.r.hget(answers_key(chainer.keys, job), next_id)
    # a template that cannot render this history ends the chain, saying why (render_error: RenderFailed)
    digest, message = await chainer.render_next(jt, job, dataset, row, conv, next_id, messages, following)
    # A re-run that now continues elsewhere (another next) drops what the old revision derived beyond it.
    dropped = tuple(p for p in later if p != next_id)
    signed = chainer._sign_answer(job, pid, recorded)
    return NextTurn(pid, signed, next_id, digest, message, drop=dropped if later and later[0] != next_id else ())


async def _execute(
    chainer: TurnChainer,
    job: str,
    pid: str,
    revision: int,
    where: tuple[str, int, int],
    calls: list[dict[str, Any]],
    meta: dict[str, Any],
    generation: str = "",
) -> list[dict[str, Any]]:
    """The executor's results for this step revision's calls (workers/tool_exec.py: recorded before the next step
    is, fenced by this run's claim in the worker's ledger)."""
    from workers.tool_exec import ToolExecutor, executed_results

    # by (job, generation): a purge and a new submit may name another executor
    executors: dict[tuple[str, str], ToolExecutor] = chainer.__dict__.setdefault("_executors", {})
    at = (job, generation)
    if at not in executors:  # the job names the executor; this worker's settings trust and limit it
        executors[at] = ToolExecutor.for_worker(str(meta.get("executor") or ""), chainer.settings)
    conv_id, turn, step = where
    place = {"conversation": conv_id, "turn": turn, "step": step}
    if chainer.ledger is None:
        raise ToolExecError(f"{pid}: no claim ledger here to fence its executor call by (a worker's chainer has one)")
    return await executed_results(chainer.ledger, executors[at], job, pid, revision, place, calls)


def _cut(jt: _JobTurns, row: dict[str, Any]) -> bool:
    """A call span that does not end with the call-end marker (cut by ``max_new_tokens``)."""
    end_id = jt.markers.end_id
    if end_id is None:
        return False
    ids = row["output_ids"]
    for s in row.get("tool_call_spans") or []:
        stop = s["end"] if isinstance(s, dict) else s[1]
        if stop <= 0 or int(ids[stop - 1]) != end_id:
            return True
    return False


async def _history(chainer: TurnChainer, job: str, conv_id: str, pid: str) -> list[dict[str, Any]]:
    """The answer records before ``pid`` in chain order: the walk from ``t0`` along ``next``."""
    out: list[dict[str, Any]] = []
    at = turn_id(conv_id, 0)
    key = answers_key(chainer.keys, job)
    while at != pid:
        raw = await chainer.r.hget(key, at)
        if raw is None or len(out) >= MAX_WALK:
            raise TurnError(f"{pid}: the answer of {at}, a step before it, is not recorded")
        record = json.loads(raw)
        if chainer.signer is not None and not chainer.signer.doc_valid("answer", job, at, record):
            raise TurnError(f"{at}: its recorded answer does not match its signature (not a worker's)")
        out.append(record)
        at = str(record.get("next") or "")
        if not at:
            raise TurnError(f"{pid}: the chain of its conversation ended before it")
    return out


async def _later(chainer: TurnChainer, job: str, old: bytes | None) -> tuple[str, ...]:
    """The prompts an earlier record of this step derived, in chain order (a re-run's stale successors)."""
    out: list[str] = []
    key = answers_key(chainer.keys, job)
    at = str(json.loads(old).get("next") or "") if old is not None else ""
    while at and len(out) < MAX_WALK:
        out.append(at)
        raw = await chainer.r.hget(key, at)
        at = str(json.loads(raw).get("next") or "") if raw is not None else ""
    return tuple(out)


class StepChainer(TurnChainer):
    """The worker's turn chainer: plain turns as :class:`TurnChainer` derives them, an agentic job's steps here."""

    async def _agentic_next(
        self, jt: _JobTurns, job: str, dataset: str, row: dict[str, Any], conv: dict[str, Any]
    ) -> NextTurn:
        return await next_step(self, jt, job, dataset, row, conv)
