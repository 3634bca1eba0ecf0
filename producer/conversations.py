"""``--turns all`` at submit: the conversations the workers render later turns from (:func:`write_conversations`),
and the stored turns they finalize again (:func:`stage_replay`, planned by :mod:`producer.chains`).

Apart from :mod:`producer.submit` because only a multi-turn job writes these: a ``--turns last`` submit never
comes here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import redis

from producer.chains import ChainReplay, plan_replay, replay_candidates
from producer.collector import Collector
from producer.enqueue import Stager
from producer.state import Existing
from producer.submit_options import SubmitOptions
from thinkfleet.settings import Settings
from thinkfleet.signing import signer_for


def stage_replay(
    settings: Settings, opts: SubmitOptions, existing: Existing, collector: Collector, stager: Stager
) -> ChainReplay:
    """--turns all: the stored turns Redis does not count done (a purge, a Redis lost entirely) are finalized
    again by the workers, from their parts and in chain order (producer/chains.py): each conversation's earliest
    one is enqueued again (counted as enqueued and as ``resumed``), never refilled into done."""
    if opts.turns != "all":
        return ChainReplay()
    finished = existing.done | existing.dead | existing.queued
    candidates = replay_candidates(existing.stored, finished, collector.kept_conversations)
    # the images of the resumed conversations, as the producer just read them: a replayed head carries its own
    convs = collector.feed.conversations if collector.feed is not None else {}
    images = [i for c in _conversations_of(candidates) for i in (convs.get(c) or {}).get("images") or []]
    replay = plan_replay(settings, opts.job, candidates, collector.generation, images)
    if replay.heads:
        messages = collector.envelope.encode_many(replay.heads)
        stager.push(messages)
        collector.enqueued += len(messages)
        collector.message_bytes += sum(map(len, messages))
    collector.resumed = len(replay.heads)
    return replay


def write_conversations(client: redis.Redis, settings: Settings, opts: SubmitOptions, collector: Collector) -> None:
    """--turns all: every conversation of the job (workers render its later turns from it) and the job hash's
    ``turns`` field (the mode, the conversations, their turns, how many a tool call cut short)."""
    from thinkfleet.turns import conversations_key

    feed = collector.feed
    assert feed is not None
    key = conversations_key(settings.keys, opts.job)
    kept = collector.kept_conversations
    signer = signer_for(settings)  # with a key, workers render later turns only from what the producer signed
    convs = {
        c: json.dumps(signer.sign_doc("conversation", opts.job, c, v) if signer else v, ensure_ascii=False)
        for c, v in feed.conversations.items()
        if c in kept
    }
    items = list(convs.items())
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, len(items), 1000):
            pipe.hset(key, mapping=dict(items[start : start + 1000]))
        pipe.execute()
    known = client.hlen(key)
    turns = sum(_turn_counts(client, key))
    meta = {
        "mode": "all",
        "conversations": known,
        "turns": turns,
        "cut_at_tool": feed.cut_at_tool,
        "trust_remote_code": opts.trust_remote_code,
        "note": "conversations are regenerated up to their first tool call (later turns need tool results)",
    }
    if opts.tool_results is not None:  # an agentic job: tool results fed back (thinkfleet/tool_steps.py)
        meta.update(tool_results=opts.tool_results, tool_mismatch=opts.tool_mismatch)
        meta["max_tool_steps"] = opts.max_tool_steps
        if opts.tool_executor:
            meta["executor"] = opts.tool_executor
        meta["note"] = "conversations are regenerated through their tool calls (thinkfleet/tool_steps.py)"
    if signer is not None:
        meta = signer.sign_doc("turns", opts.job, "", meta)
    client.hset(settings.keys.job(opts.job), "turns", json.dumps(meta))


def _turn_counts(client: redis.Redis, key: str) -> Iterator[int]:
    for _conv, raw in client.hscan_iter(key, count=1000):
        yield int(json.loads(raw)["turn_count"])


def _conversations_of(prompt_ids: set[str]) -> set[str]:
    from thinkfleet.turns import split_step_id

    return {p[0] for pid in prompt_ids if (p := split_step_id(pid)) is not None}
