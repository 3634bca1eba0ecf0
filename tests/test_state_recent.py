"""thinkfleet.state.recent.Recent: the bounded memory of the writes a worker replays after a Redis rollback."""

from thinkfleet.state.recent import Recent


def test_keeps_the_latest_entries_and_a_remembered_key_becomes_the_newest() -> None:
    recent: Recent[str, int] = Recent(3)
    for i, key in enumerate("abc"):
        recent.remember(key, i)
    recent.remember("a", 10)  # again: newest now, so "b" is the oldest
    recent.remember("d", 3)
    assert list(recent.items()) == [("c", 2), ("a", 10), ("d", 3)]
    assert "b" not in recent
    assert len(recent) == recent.size == 3
