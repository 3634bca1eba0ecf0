"""``producer wait`` must not call a ``--turns all`` job finished while a later turn is owed.

A turn's finalize (finalize.lua) moves it into done and enqueues its conversation's next turn — counted submitted —
in one atomic step. A status read that takes the submitted prompts in one Redis call and the done set in a later
one can see the old prompts and the new done set: when the last pending prompts are turns whose finalize enqueues
their successors, every prompt it knows of is done, remaining = 0, the chains all wait on submitted turns (not
stranded), and ``wait`` exits 0 with the later turns still to run (seen under load in the operator matrix,
turns × compact_export: 3 of 6 turns exported after wait said finished).

The test runs the reader against real Redis and a real ledger, and lets a worker's group commit of every turn 0
land exactly in that window (right after the reader has read the job's prompts): the read must not say finished;
once the later turns are finalized too, it must.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from producer.status import StatusReader
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import conversation_rows, write_jsonl
from testing.harness import isolated_settings
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import FinalRow, Ledger
from workers.turns import NextTurn

JOB, CONVERSATIONS, TURNS, WORKER = "wr", 3, 2, "w1"


def _answer() -> str:
    return json.dumps({"role": "assistant", "content": "ok"})


def _finalize_turn(settings: Settings, redis_url: str, turn: int) -> None:
    """One worker's group commit: every conversation's ``turn`` claimed and finalized in one finalize call, each
    enqueuing its next turn (onto a scratch list: nothing consumes it here) when there is one."""
    keys, ds = settings.keys, "chat"

    async def run() -> None:
        client = aioredis.from_url(redis_url)
        await client.set(keys.heartbeat(WORKER), "1")
        ledger = Ledger(client, keys, WORKER)
        try:
            rows, turns = [], []
            for c in range(CONVERSATIONS):
                pid = f"{ds}/c{c}/t{turn}"
                claim = await ledger.claim(JOB, pid)
                rows.append(FinalRow(pid, 5, True, False, epoch=claim.epoch))
                nxt = f"{ds}/c{c}/t{turn + 1}" if turn + 1 < TURNS else ""
                turns.append(NextTurn(pid, _answer(), nxt, "h" if nxt else "", b"m" if nxt else b""))
            done = await ledger.finalize(
                JOB, ds, rows, 100, 0.95, turns, f"{settings.queue}-scratch", keys.turn_answers(JOB)
            )
            assert done.new == CONVERSATIONS, done
        finally:
            await client.aclose()

    asyncio.run(run())


class _CommitAfterPromptsRead(redis.Redis):
    """A real client that, the first time the job's prompts are read (``prompt_dataset``), lets ``commit`` run
    before it returns them: a worker's finalize landing between the reader's Redis calls, as a loaded box lets it."""

    _watch: str = ""
    _commit: Any = None
    fired = False

    def hgetall(self, name: Any) -> Any:  # type: ignore[override]
        out = super().hgetall(name)
        if not self.fired and name == self._watch:
            self.fired = True
            self._commit()
        return out


def test_wait_is_not_finished_while_a_finalize_enqueues_the_next_turns_mid_read(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    data = write_jsonl(tmp_path / "chat.jsonl", conversation_rows(CONVERSATIONS, TURNS, 6, "Be brief."))
    submit(settings, SubmitOptions(paths=[data], job=JOB, tokenizer=str(tok), processes=1, turns="all"))
    keys = settings.keys
    plain = redis.Redis.from_url(redis_url)
    try:
        racing = _CommitAfterPromptsRead.from_url(redis_url)
        racing._watch, racing._commit = keys.prompt_dataset(JOB), lambda: _finalize_turn(settings, redis_url, 0)
        try:
            st = StatusReader(racing, settings, JOB).read(deep=True)
        finally:
            racing.close()
        assert racing.fired, "the read never read the job's prompts: the window moved"
        # the commit landed mid-read: turn 0 done, every turn 1 enqueued and owed
        assert plain.hlen(keys.prompts(JOB)) == CONVERSATIONS * TURNS
        assert plain.scard(keys.done(JOB)) == CONVERSATIONS
        assert not st["finished"], {k: st[k] for k in ("total", "done", "dead", "remaining", "conversations")}

        # the next reads see the later turns pending, both ways of counting
        for deep in (True, False):
            st = StatusReader(plain, settings, JOB).read(deep=deep)
            assert not st["finished"] and st["remaining"] == CONVERSATIONS, (deep, st["remaining"])

        # and once they are finalized the job is finished (the fix does not keep wait waiting)
        _finalize_turn(settings, redis_url, 1)
        for deep in (True, False):
            st = StatusReader(plain, settings, JOB).read(deep=deep)
            assert st["finished"] and st["remaining"] == 0, (deep, st["remaining"])
            assert st["conversations"]["complete"] == CONVERSATIONS and not st["conversations"]["stranded"]
    finally:
        plain.close()
