"""BENCHMARKS.md: each benchmark rewrites only its own section, between its own markers."""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, ROOT

BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
#: Everything BENCHMARKS.md holds outside the benchmarks' own sections (rewritten with every section).
HEADER = """# Benchmarks

Every section below is written by its benchmark, between its own `<!-- name:begin -->` and
`<!-- name:end -->` markers, from the JSON that run saved under `bench/results/`; none is typed by hand.
Each names the command that re-runs it and the commit of the whole tree it ran on (`+ uncommitted
changes` and a hash of them when the tree differed from that commit).

Re-run everything (≈ 20 min on the 2-core dev VM; `pip install -e '.[bench]'` adds py-spy and matplotlib):

    .venv/bin/python -m bench.bench_storage
    .venv/bin/python -m bench.bench_storage --logprobs --rows 1024
    .venv/bin/python -m bench.bench_worker
    .venv/bin/python -m bench.bench_producer --prompts 10000
    .venv/bin/python -m bench.bench_fleet
    .venv/bin/python -m bench.bench_fault_cost
    .venv/bin/python -m bench.bench_affinity
    .venv/bin/python -m bench.bench_vision --prompts 500 --worker-prompts 1000

Rebuild every section from the saved JSON without re-running anything: `.venv/bin/python -m bench.report`
(one section: the benchmark's own `--from-json bench/results/NAME.json`).
"""
#: (section key, module, saved JSON): what ``python -m bench.report`` re-renders, in BENCHMARKS.md's order.
SECTIONS = (
    ("bench_storage", "bench.bench_storage", "storage.json"),
    ("bench_storage_logprobs", "bench.bench_storage", "storage_logprobs.json"),
    ("bench_worker", "bench.bench_worker", "worker.json"),
    ("bench_producer", "bench.bench_producer", "producer.json"),
    ("bench_fleet", "bench.bench_fleet", "fleet.json"),
    ("bench_scale", "bench.bench_scale", "scale.json"),
    ("bench_fault_cost", "bench.bench_fault_cost", "fault_cost.json"),
    ("bench_affinity", "bench.bench_affinity", "affinity.json"),
    ("bench_vision", "bench.bench_vision", "vision.json"),
)


def code_stamp(code: dict[str, Any] | None) -> str:
    """The tree a result ran on, for a section: ``Code at `abc1234` (clean)`` or with its uncommitted diff."""
    if not code or not code.get("commit"):
        return "Code version not recorded."
    short = code["commit"][:7]
    if "dirty" not in code:  # a result from before the whole-tree stamp: what it recorded, as it recorded it
        return f"Code at `{short}` (recorded before whole-tree stamps; uncommitted changes unknown)."
    if not code["dirty"]:
        return f"Code at `{short}` (clean tree)."
    paths = code.get("changed_paths", [])
    return (
        f"Code at `{short}` + uncommitted changes (diff sha256 `{code.get('diff_sha256', '?')}`, "
        f"{len(paths)} path{'s' if len(paths) != 1 else ''}: {', '.join(f'`{p}`' for p in paths[:6])}"
        f"{', …' if len(paths) > 6 else ''})."
    )


def replace_section(text: str, key: str, title: str, body: str) -> str:
    """``text`` with the ``key`` section set to ``## title`` + ``body`` (appended if new), under :data:`HEADER`.

    Other sections are kept byte for byte; whatever stood before the first marker becomes :data:`HEADER`.
    """
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n## {title}\n\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    first = re.search(r"^<!-- [\w-]+:begin -->", text, re.M)
    return HEADER + "\n" + text[first.start() if first else len(text) :]


def update_section(key: str, title: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Rewrite one section of ``path`` in place (see :func:`replace_section`), under a lock."""
    path.touch(exist_ok=True)
    with open(path, "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another benchmark may be writing its own section right now
        text = replace_section(f.read(), key, title, body)
        f.seek(0)
        f.write(text)
        f.truncate()


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    """Re-render every section whose JSON is saved (each benchmark's ``--from-json``); runs nothing."""
    for key, module, name in SECTIONS:
        saved = RESULTS / name
        if not saved.exists():
            print(f"{key}: {saved.relative_to(ROOT)} not found, section left as it is")
            continue
        args = [sys.executable, "-m", module, "--from-json", str(saved)]
        if key == "bench_storage_logprobs":
            args.append("--logprobs")
        subprocess.run(args, cwd=ROOT, check=True)
        print(f"{key}: re-rendered from {saved.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
