"""BENCHMARKS.md: each benchmark rewrites only its own section, between its own markers."""

from __future__ import annotations

import fcntl
import re
from pathlib import Path

from bench.harness import ROOT

BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
_HEADER = (
    "# Benchmarks\n\nEach section is written by its benchmark; the command that regenerates it is in the section.\n"
)


def update_section(key: str, title: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace ``## title`` + body between ``<!-- key:begin -->`` and ``<!-- key:end -->`` (append if new)."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n## {title}\n\n{body.strip()}\n{end}"
    path.touch(exist_ok=True)
    with open(path, "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another benchmark may be writing its own section right now
        text = f.read() or _HEADER
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
        f.seek(0)
        f.write(text)
        f.truncate()


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
