"""thinkfleet.failpoints: parsing, arming, shot counting (in and across processes), keys, and placement."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from thinkfleet import failpoints
from thinkfleet.failpoints import (
    ACTIONS,
    DIR_ENV,
    ENV,
    POINTS,
    PRODUCER_POINTS,
    TIMES_ENV,
    TOOL_POINTS,
    WORKER_POINTS,
    FailpointError,
    arm,
    failpoint,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def shots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Marker files go to a private dir; every test starts and ends disarmed."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.delenv(TIMES_ENV, raising=False)
    arm("")
    yield tmp_path
    arm("")


def fires(name: str, key: str | None = None) -> bool:
    try:
        failpoint(name, key)
    except FailpointError as exc:
        assert str(exc) == f"failpoint {name}"
        return True
    return False


def test_the_points_are_the_worker_points_then_the_producers() -> None:
    assert POINTS == WORKER_POINTS + TOOL_POINTS + PRODUCER_POINTS
    assert len(set(POINTS)) == len(POINTS)
    assert ACTIONS == ("raise", "kill", "stop")


def test_parse_reads_action_count_and_key_of_each_item() -> None:
    armed = failpoints._parse(" after_claim=raise , after_part_write=kill:3,during_generate=raise:always@p00003,")
    assert armed == {
        "after_claim": failpoints._Arm("raise", None, None),
        "after_part_write": failpoints._Arm("kill", 3, None),
        "during_generate": failpoints._Arm("raise", -1, "p00003"),
    }
    assert failpoints._parse("") == {} and failpoints._parse(" , ") == {}
    assert failpoints._parse("before_ack=kill@a/b#1") == {"before_ack": failpoints._Arm("kill", None, "a/b#1")}


@pytest.mark.parametrize(
    "spec",
    [
        "nowhere=raise",  # unknown point
        "after_pop=explode",  # unknown action
        "after_pop",  # no action
        "after_pop=",
        "=raise",
        "after_pop=raise:abc",  # a count that is no number
        "after_pop=raise:-1",
        "after_pop=raise:2.5",
        "after_pop=raise:ALWAYS",
        "after_pop=raise,after_claim=crash",  # one bad item spoils the spec
    ],
)
def test_a_bad_spec_raises_value_error_naming_the_item_and_keeps_the_arming(spec: str) -> None:
    arm("after_claim=raise")
    with pytest.raises(ValueError, match=rf"{ENV}: bad item"):
        arm(spec)
    assert fires("after_claim"), "the previous arming is still in force"


def test_unarmed_points_do_nothing(shots: Path) -> None:
    for name in POINTS:
        failpoint(name, "p00000")
    assert not list(shots.iterdir())


def test_a_point_fires_once_by_default_and_leaves_a_marker(shots: Path) -> None:
    arm("after_claim=raise")
    assert not fires("after_pop"), "only the armed point fires"
    assert fires("after_claim", "p00001")
    assert not fires("after_claim", "p00001") and not fires("after_claim", "p00002")
    assert sorted(p.name for p in shots.iterdir()) == ["failpoint-after_claim-0"]


def test_re_arming_does_not_refill_spent_shots(shots: Path) -> None:
    arm("after_claim=raise")
    assert fires("after_claim")
    arm("after_claim=raise")
    assert not fires("after_claim"), "the marker file counts the shot, not the arming"


def test_a_count_gives_that_many_shots(shots: Path) -> None:
    arm("after_mark=raise:3")
    assert [fires("after_mark") for _ in range(5)] == [True, True, True, False, False]
    assert sorted(p.name for p in shots.iterdir()) == [f"failpoint-after_mark-{i}" for i in range(3)]


def test_the_default_count_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMES_ENV, "2")
    arm("before_ack=raise")
    assert [fires("before_ack") for _ in range(3)] == [True, True, False]


def test_always_fires_every_time_and_counts_nothing(shots: Path) -> None:
    arm("during_generate=raise:always")
    assert all(fires("during_generate", f"p{i}") for i in range(5))
    assert not list(shots.iterdir())


def test_a_key_narrows_the_point_to_one_prompt_and_others_spend_no_shot(shots: Path) -> None:
    arm("after_claim=raise@p00003")
    assert not fires("after_claim", "p00001")
    assert not fires("after_claim"), "a call site that passes no key never matches a keyed arming"
    assert not list(shots.iterdir())
    assert fires("after_claim", "p00003")
    assert not fires("after_claim", "p00003"), "one shot"


def test_a_keyed_always_fires_for_its_prompt_only() -> None:
    arm("after_claim=raise:always@p00003")
    assert [fires("after_claim", k) for k in ("p00003", "p00004", "p00003")] == [True, False, True]


def _child(shots: Path, spec: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ENV: spec, DIR_ENV: str(shots)}
    env.pop(TIMES_ENV, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_kill_sigkills_the_process_once_across_processes(shots: Path) -> None:
    # The environment arms the module at import; a kill is a SIGKILL, with no cleanup.
    code = "from thinkfleet.failpoints import failpoint; failpoint('after_part_write'); print('survived')"
    first = _child(shots, "after_part_write=kill", code)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout
    assert (shots / "failpoint-after_part_write-0").exists()
    # A restarted process (same arming, same marker dir) does not die again.
    second = _child(shots, "after_part_write=kill", code)
    assert second.returncode == 0 and "survived" in second.stdout


def test_a_bad_environment_spec_fails_the_import(shots: Path) -> None:
    result = _child(shots, "after_pop=boom", "import thinkfleet.failpoints")
    assert result.returncode != 0 and "ValueError" in result.stderr and "bad item 'after_pop=boom'" in result.stderr


def test_every_point_is_placed_in_the_code() -> None:
    files = [p for d in ("workers", "producer") for p in (ROOT / d).rglob("*.py")]
    sources = "\n".join(p.read_text() for p in files)
    placed = set(re.findall(r"""failpoint\(\s*["']([a-z_]+)["']""", sources))
    assert placed == set(POINTS)
