"""The suspect group's admission (workers/suspects.py): suspects run together up to every member's cap, in
arrival order, so a run that must be alone waits for the group to empty and is not starved by larger caps."""

from __future__ import annotations

import asyncio

from workers.suspects import NO_CAP, SuspectGroup, cap_of


def test_suspects_without_a_cap_run_together() -> None:
    async def scenario() -> None:
        group = SuspectGroup()
        sizes = [await group.join(("j", f"p{i}"), NO_CAP) for i in range(5)]
        assert sizes == [1, 2, 3, 4, 5] and group.largest == 5

    asyncio.run(scenario())


def test_a_split_member_waits_for_room_and_blocks_later_arrivals_until_it_runs() -> None:
    async def scenario() -> None:
        group = SuspectGroup()
        await group.join(("j", "a"), NO_CAP)
        await group.join(("j", "b"), NO_CAP)
        alone = asyncio.create_task(group.join(("j", "lone"), 1))  # its group died twice: it runs alone
        later = asyncio.create_task(group.join(("j", "late"), NO_CAP))
        await asyncio.sleep(0.05)
        assert not alone.done() and not later.done(), "the lone run waits for the group to empty; the next behind it"
        await group.leave(("j", "a"))
        await group.leave(("j", "b"))
        assert await asyncio.wait_for(alone, 1) == 1
        await asyncio.sleep(0.05)
        assert not later.done(), "nobody joins a run whose cap is 1"
        await group.leave(("j", "lone"))
        assert await asyncio.wait_for(later, 1) == 1

    asyncio.run(scenario())


def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    async def scenario() -> None:
        group = SuspectGroup()
        await group.join(("j", "a"), 1)
        waiting = asyncio.create_task(group.join(("j", "b"), NO_CAP))
        next_one = asyncio.create_task(group.join(("j", "c"), NO_CAP))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await group.leave(("j", "a"))
        assert await asyncio.wait_for(next_one, 1) == 1

    asyncio.run(scenario())


def test_the_cap_comes_from_the_delivery_record() -> None:
    assert cap_of({"x": 0, "k": 3, "g": 2}) == 2
    assert cap_of({"k": 2}) == NO_CAP and cap_of(None) == NO_CAP and cap_of({"g": 0}) == NO_CAP
