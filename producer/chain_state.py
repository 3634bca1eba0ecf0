"""Where each conversation of a ``--turns all`` job stands, from its small chain-state record.

finalize.lua records, with each answer, its conversation's chain state (``Keys.chain_state``: conversation →
``[prompt id, link]``, link ``>{next prompt id}`` or ``={chain_end reason}``): the chain's last finalized link, a
few dozen bytes a conversation; and, as the states change, where the chains stand: the counters'
``chains_complete`` and ``chains_ended:{kind}``, and the set of conversations whose chain goes on
(``Keys.chain_waiting``). ``producer status`` and ``wait`` read the counters and the waiting chains' states (at the
end of a job, only the dead and stranded ones); ``retry`` reads the states. None of them walks every answer record
(each a decoded answer of ~10 KB: GBs at the end of a large job, on every call of ``status --watch``).

A job whose answers were recorded by workers that kept no chain state (an older fleet) has answers and no state:
:func:`read_chain_state` says so (None), and the callers walk the answers as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from thinkfleet.chain_end import COMPLETE
from thinkfleet.keys import Keys
from thinkfleet.tool_steps import END_TOOL_ERROR

#: Fields per HSCAN page of the chain-state hash (each a few dozen bytes).
SCAN_COUNT = 5000
#: The counters' field of the chains whose end is an executor failure (finalize.lua counts each end once).
TOOL_ERRORS_FIELD = f"chains_ended:{END_TOOL_ERROR}"


@dataclass(frozen=True)
class ChainState:
    """One conversation's chain: its last finalized prompt and where that leaves the chain."""

    prompt_id: str
    #: the prompt the chain goes on to ("" when it ended)
    next_id: str
    #: why it ended (thinkfleet/chain_end.py: ``complete``, ``tool_call``, ``error: …``); "" while it goes on
    end: str

    @classmethod
    def parse(cls, raw: bytes | str) -> ChainState:
        pid, link = json.loads(raw)
        if link.startswith(">"):
            return cls(str(pid), link[1:], "")
        return cls(str(pid), "", link[1:])


def keeps_chain_state(client: redis.Redis, keys: Keys, job: str) -> bool:
    """Whether the job's chains are recorded in chain states (False: answers were recorded without them, by an
    older fleet's workers — walk the answers)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hlen(keys.chain_state(job))
        pipe.exists(keys.turn_answers(job))
        size, answered = pipe.execute()
    return bool(size) or not answered


def ended_counts(counters: dict[str, int]) -> tuple[int, dict[str, int]]:
    """(complete chains, ended chains per kind of reason), from the job's counters (finalize.lua keeps them)."""
    ends = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("chains_ended:") and v > 0}
    return max(0, counters.get("chains_complete", 0)), dict(sorted(ends.items()))


def waiting_states(client: redis.Redis, keys: Keys, job: str) -> dict[str, ChainState]:
    """Conversation → :class:`ChainState` of each conversation whose chain goes on (``chain_waiting``): at the end
    of a job only the dead and the stranded ones, so reading them costs nothing like reading every chain."""
    convs = sorted(m.decode() for m in client.sscan_iter(keys.chain_waiting(job), count=SCAN_COUNT))
    out: dict[str, ChainState] = {}
    for start in range(0, len(convs), SCAN_COUNT):
        chunk = convs[start : start + SCAN_COUNT]
        for conv, raw in zip(chunk, client.hmget(keys.chain_state(job), chunk), strict=True):
            if raw is not None:
                out[conv] = ChainState.parse(raw)
    return out


def read_chain_state(client: redis.Redis, keys: Keys, job: str) -> dict[str, ChainState] | None:
    """Conversation → :class:`ChainState` of every conversation with a finalized turn; None when the job's answers
    were recorded without it (an older fleet's workers: walk the answers instead)."""
    key = keys.chain_state(job)
    with client.pipeline(transaction=False) as pipe:
        pipe.hlen(key)
        pipe.exists(keys.turn_answers(job))
        size, answered = pipe.execute()
    if not size:
        return None if answered else {}
    return {conv.decode(): ChainState.parse(raw) for conv, raw in client.hscan_iter(key, count=SCAN_COUNT)}


def chain_end_ids(client: redis.Redis, keys: Keys, job: str) -> list[str]:
    """The prompt ids whose answer ended their conversation's chain with a reason (``chain_end``: what
    ``thinkfleet.turns.beyond_chain_ends`` takes), from the chain state, or from the answer records of a job recorded
    without it."""
    states = read_chain_state(client, keys, job)
    if states is not None:
        return sorted(s.prompt_id for s in states.values() if s.end and s.end != COMPLETE)
    return [
        pid.decode()
        for pid, raw in client.hscan_iter(keys.turn_answers(job), count=1000)
        if b"chain_end" in raw and "chain_end" in json.loads(raw)
    ]
