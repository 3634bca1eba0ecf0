"""The operator matrix's results as one Markdown table (tests/test_operator_matrix.py): kinds × commands.

Each cell records pass, FAIL or a known bug (a strict xfail); :meth:`MatrixResults.write` puts the table between
``<!-- operator-matrix:begin -->`` and ``<!-- operator-matrix:end -->`` in a file (RELIABILITY.md), leaving the rest
of it as it is. A cell this run did not reach keeps the previous table's entry (a ``-k`` run updates its cells only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BEGIN, END = "<!-- operator-matrix:begin -->", "<!-- operator-matrix:end -->"
#: The section of RELIABILITY.md the table lives in, and the heading bench/reliability_report.py puts it before.
MATRIX_HEADING, BODY_HEADING = "## Every job kind × every operator command", "## What the suite found"


class MatrixResults:
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {}
        self.bugs: dict[tuple[str, str], str] = {}
        self.kinds: list[str] = []
        self.commands: list[str] = []

    @contextmanager
    def cell(self, kind: str, command: str, known_bug: str | None = None) -> Iterator[None]:
        """Record how the cell's block ends: pass, a known bug (it failed as expected) or FAIL."""
        self.kinds += [kind] if kind not in self.kinds else []
        self.commands += [command] if command not in self.commands else []
        if known_bug:
            self.bugs[kind, command] = known_bug
        try:
            yield
        except BaseException:
            self.cells[kind, command] = "known bug" if known_bug else "FAIL"
            raise
        self.cells[kind, command] = "FIXED?" if known_bug else "pass"

    def table(self, previous: dict[tuple[str, str], str] | None = None) -> str:
        cells = {**(previous or {}), **self.cells}
        kinds = list(dict.fromkeys([*(k for k, _ in previous or {}), *self.kinds]))  # the table's order first
        commands = list(dict.fromkeys([*(c for _, c in previous or {}), *self.commands]))
        lines = ["| kind \\ command | " + " | ".join(f"`{c}`" for c in commands) + " |"]
        lines.append("|---|" + "---|" * len(commands))
        for kind in kinds:
            lines.append(f"| {kind} | " + " | ".join(cells.get((kind, c), "—") for c in commands) + " |")
        if self.bugs:
            lines += ["", "Known bugs (strict xfail until fixed):", ""]
            lines += [f"- {kind} × `{command}`: {why}" for (kind, command), why in self.bugs.items()]
        return "\n".join(lines)

    def write(self, path: str | None) -> None:
        """Replace the marked block of ``path`` with the table (appended, with its markers, if it has none)."""
        if not path or not self.cells:
            return
        target = Path(path)
        text = target.read_text() if target.exists() else ""
        block = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S)
        previous = block.group(1).strip() if block else ""
        for cell, why in _parse_bugs(previous).items():  # a cell this run did not reach keeps its note
            if cell not in self.cells:
                self.bugs.setdefault(cell, why)
        table = f"{BEGIN}\n{self.table(_parse(previous))}\n{END}"
        text = text[: block.start()] + table + text[block.end() :] if block else f"{text.rstrip()}\n\n{table}\n"
        target.write_text(text)


def _parse(table: str) -> dict[tuple[str, str], str]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    if len(rows) < 2:
        return {}
    commands = [c.strip("`") for c in rows[0][1:]]
    return {(r[0], c): v for r in rows[2:] for c, v in zip(commands, r[1:], strict=False) if v != "—"}


def _parse_bugs(table: str) -> dict[tuple[str, str], str]:
    found = (re.match(r"- (\S+) × `([^`]+)`: (.*)", line) for line in table.splitlines())
    return {(m.group(1), m.group(2)): m.group(3) for m in found if m}


def keep_block(rendered: str, path: Path) -> str:
    """``rendered`` (bench/reliability_report.py's page) with ``path``'s operator-matrix section kept: the report
    rewrites RELIABILITY.md from its scenario rows, and the matrix is written by its own test run."""
    old = path.read_text() if path.exists() else ""
    start, end = old.find(MATRIX_HEADING), old.find(END)
    if start < 0 or end < 0 or MATRIX_HEADING in rendered:
        return rendered
    section = old[start : end + len(END)] + "\n\n"
    at = rendered.find(BODY_HEADING)
    return rendered[:at] + section + rendered[at:] if at >= 0 else f"{rendered.rstrip()}\n\n{section}"
