"""BENCHMARKS.md machinery: a benchmark rewrites only its own marked section, and says which tree it ran on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.harness import code_version
from bench.report import HEADER, code_stamp, replace_section, update_section

OTHERS = """# Benchmarks

an old hand-written intro

<!-- bench_a:begin -->
## A

a's body, with | a table | and `code`
<!-- bench_a:end -->

<!-- bench_b:begin -->
## B

b's old body
<!-- bench_b:end -->
"""


def test_replacing_a_section_keeps_the_others_byte_for_byte() -> None:
    # Given a file with two marked sections
    # When B is rewritten
    text = replace_section(OTHERS, "bench_b", "B", "b's new body\n")
    # Then A is untouched, B holds only the new body, and the header is the generated one
    a = OTHERS[OTHERS.index("<!-- bench_a:begin -->") : OTHERS.index("<!-- bench_a:end -->")]
    assert a in text
    assert "b's new body" in text and "b's old body" not in text
    assert text.startswith(HEADER) and "hand-written intro" not in text
    assert text.count("<!-- bench_b:begin -->") == text.count("<!-- bench_b:end -->") == 1


def test_a_new_section_is_appended_after_the_others() -> None:
    text = replace_section(OTHERS, "bench_c", "C", "c")
    assert text.index("<!-- bench_b:end -->") < text.index("<!-- bench_c:begin -->\n## C\n\nc\n<!-- bench_c:end -->")


def test_rewriting_twice_gives_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(OTHERS)
    update_section("bench_a", "A", "again", path)
    once = path.read_text()
    update_section("bench_a", "A", "again", path)
    assert path.read_text() == once


def test_a_body_with_regex_specials_is_written_verbatim() -> None:
    body = r"a \1 backreference and \g<0> and $ signs"
    assert body in replace_section(OTHERS, "bench_a", "A", body)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path


def test_the_stamp_names_the_commit_and_a_clean_tree(repo: Path) -> None:
    stamp = code_version(repo)
    assert stamp == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False}
    assert f"`{stamp['commit'][:7]}` (clean tree)" in code_stamp(stamp)


def test_a_change_under_bench_makes_the_stamp_dirty_with_a_diff_hash(repo: Path) -> None:
    # Given a committed tree, when a file under bench/ changes and an untracked file appears
    (repo / "bench" / "x.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    stamp = code_version(repo)
    # Then the stamp is dirty, names both paths and hashes the difference
    assert stamp["dirty"] is True
    assert stamp["changed_paths"] == ["bench/x.py", "new.py"]
    assert len(stamp["diff_sha256"]) == 16
    assert stamp["diff_sha256"] in code_stamp(stamp) and "uncommitted" in code_stamp(stamp)
    # And the same tree hashes the same; another change hashes differently
    assert code_version(repo)["diff_sha256"] == stamp["diff_sha256"]
    (repo / "new.py").write_text("y = 2\n")
    assert code_version(repo)["diff_sha256"] != stamp["diff_sha256"]


def test_the_benchmarks_own_outputs_do_not_make_the_tree_dirty(repo: Path) -> None:
    (repo / "BENCHMARKS.md").write_text("# Benchmarks\n")
    (repo / "bench" / "results").mkdir()
    (repo / "bench" / "results" / "fleet.json").write_text("{}\n")
    assert code_version(repo)["dirty"] is False


def test_a_partial_reliability_run_sets_aside_only_its_own_files_rows(tmp_path: Path) -> None:
    import json

    from bench.reliability_report import _PREVIOUS, _test_files, clear_stale

    failover = _test_files(["test_reliability_failover*"])
    assert failover and all(p.name.startswith("test_reliability_failover") for p in failover)
    assert len(_test_files()) > len(failover)
    rows = {
        "mine": {"test": f"tests/{failover[0].name}::test_x", "ci": True},
        "other": {"test": "tests/test_reliability_workers.py::test_y", "ci": True},
    }
    for name, row in rows.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(row))
    moved = clear_stale(tmp_path, slow=False, files=failover)
    assert [p.name for p in moved] == ["mine.json"]
    assert (tmp_path / "other.json").exists() and (tmp_path / _PREVIOUS / "mine.json").exists()
