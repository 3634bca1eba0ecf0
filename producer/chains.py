"""A re-submit of a ``--turns all`` job resumes every conversation from its stored turns (after ``producer purge``
or a Redis lost entirely, or a turn whose finalize Redis lost).

A stored turn that Redis does not count done was never finalized *in this Redis*: its answer record and its
successor (the next turn, or the next step of an agentic turn) are not there. Returning it to ``done`` (as the
done refill does for a single-turn prompt) would strand its conversation: nothing would derive the turn after it.
So its finalize is *replayed* by the workers, through their own finalize path — the one a worker takes for a row
an earlier run committed and never finalized (the orphan recovery, workers/turns.py ``plan_stored``): the same
tokenizer, template and derivation code, with the record in force (the new generation), and the answer record,
the successor's message and ``done`` written in one Lua call (thinkfleet/state/lua/finalize.lua). Nothing of the
derivation is done here.

How (:func:`plan_replay`): every such turn gets a *settled claim naming its part* — the state a claim given back
after an ambiguous commit is left in (release.lua): whoever claims the prompt next finds the part committed and
finalizes from it instead of generating a second row, and no death is charged. The earliest such turn of each
conversation (its *head*: turn 0 after a purge) is enqueued again, its message built from the stored row itself
(the prompt ids the row was generated from). A worker finalizes the head from its part, which enqueues turn 1 —
whose claim names its part too, so it is finalized from there, and so on along the stored chain — until a turn
with no stored row, which is generated as usual, or the end of the chain (the worker's own rule decides: the
last turn, a tool call, a chain end its answer records). A turn stored past a chain end is never reached: it
stays out of ``done`` (superseded), as a finalize that ended the chain there would have left it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from producer.row_media import ROW_MEDIA_COLUMNS, RebuildRefused, RowMedia, checked_hash
from producer.sources import InputError
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.turns import of_conversations, split_step_id

#: The columns of a stored turn the replay reads (its input ids only for the heads, from their parts).
_LIGHT = ("dataset", "row_index", "revision")


@dataclass
class ChainReplay:
    """What a re-submit writes so that the workers replay the finalize of stored, unfinalized turns."""

    #: prompt id → the settled claim naming the part its stored row is in (JSON), for every such turn
    claims: dict[str, str] = field(default_factory=dict)
    #: the earliest such turn of each conversation, enqueued again (its message from the stored row)
    heads: list[PromptTask] = field(default_factory=list)

    @property
    def held(self) -> set[str]:
        """Stored turns the workers finalize (the done refill leaves them out)."""
        return set(self.claims)


def replay_candidates(stored: Iterable[str], finished: set[str], conversations: set[str]) -> set[str]:
    """Stored turn prompt ids of ``conversations`` that are not done, dead, queued or running (``finished``):
    their finalize must be replayed."""
    return of_conversations(stored, conversations, finished)


def plan_replay(
    settings: Settings, job: str, candidates: set[str], generation: str, images: Iterable[Any] = ()
) -> ChainReplay:
    """The settled claims and head messages that make the workers finalize ``candidates`` (stored turns, see
    :func:`replay_candidates`) from their parts, in chain order, with the record of ``generation``. A head of an
    image conversation carries its row's images (producer/row_media.py; ``images``: the conversations' wire
    references, which give each image's size) and must hash to its row's content hash: a head that does not is
    refused here (:class:`producer.sources.InputError`, naming the row), never sent to be refused by a worker."""
    if not candidates:
        return ChainReplay()
    from storage import layout
    from storage.reader import read_keys, scan_parts, winner_indices

    keys = read_keys(settings.output_uri, job, columns=_LIGHT, s3_endpoint_url=settings.s3_endpoint_url)
    winners = keys.take(winner_indices(keys))
    winners = winners.filter(pc.is_in(winners["prompt_id"], value_set=pa.array(sorted(candidates), pa.string())))
    rows = {r["prompt_id"]: r for r in winners.select(["prompt_id", "part", *_LIGHT]).to_pylist()}
    now = time.time()
    replay = ChainReplay()
    heads: dict[str, tuple[int, int, str]] = {}
    for pid, row in rows.items():
        # Settled, owned by nobody: claim.lua hands it to the next claimer as 'stale' without charging a death,
        # and the worker finalizes from the part it names (workers/pipeline.py, the orphan recovery).
        replay.claims[pid] = json.dumps({"worker": "", "part": row["part"], "at": now, "settled": True})
        conv, turn, step = split_step_id(pid)  # type: ignore[misc]
        if conv not in heads or (turn, step) < heads[conv][:2]:
            heads[conv] = (turn, step, pid)
    head_ids = {pid for _t, _s, pid in heads.values()}
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    parts = sorted({loc.path(rows[pid]["part"]) for pid in head_ids})
    ids = scan_parts(loc, parts, ["prompt_id", "input_ids", "content_hash", *ROW_MEDIA_COLUMNS])
    media = RowMedia(settings.s3_endpoint_url)
    media.learn(images)
    found = ids.filter(pc.is_in(ids["prompt_id"], value_set=pa.array(sorted(head_ids), pa.string())))
    queued: set[str] = set()  # heads already made (a part may hold a prompt's row twice)
    for head in found.to_pylist():
        pid = head["prompt_id"]
        row = rows.get(pid)
        if row is None or head["part"] != row["part"] or pid in queued:
            continue  # another row of it (not the winner's part)
        queued.add(pid)
        prompt = list(head["input_ids"])
        named = {**head, "dataset": row["dataset"], "row_index": row["row_index"], "revision": row["revision"]}
        try:
            refs = media.refs(named)
            digest = checked_hash(named, prompt, refs)
        except RebuildRefused as exc:
            raise InputError(
                f"cannot resume conversation {split_step_id(pid)[0]} from storage: {exc} (the stored turn is in part "  # type: ignore[index]
                f"{row['part']}; remove or quarantine that part, then submit again)"
            ) from None
        replay.heads.append(
            PromptTask(
                job,
                row["dataset"],
                pid,
                int(row["row_index"]),
                digest,
                pack_ids(prompt),
                revision=int(row["revision"] or 0),
                generation=generation,
                media=refs,
            )
        )
    replay.heads.sort(key=lambda t: t.prompt_id)
    return replay
