"""What ``producer verify JOB`` found (:class:`VerifyReport`), and how it reads for people (:func:`format_report`).

The report is the contract between the check (storage/verify.py, which fills it) and its readers: ``producer
verify`` prints it as text or JSON (``to_dict``) and exits on ``ok``; tests and the benchmarks read its fields.
Keeping it and its rendering apart from the check lets a reader see every finding, and which of them fail, in one
place; storage/verify.py's docstring says how each is found.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class VerifyReport:
    job: str
    submitted_source: str  # "redis", "manifest" or "none"
    submitted: int = 0
    stored_rows: int = 0  # every row in storage, duplicates included
    committed: int = 0  # distinct prompt ids in storage
    missing: list[str] = field(default_factory=list)
    #: --turns all: later turns never enqueued (turn i stored, no chain end, turn i+1 nowhere): prompt ids
    missing_turns: list[str] = field(default_factory=list)
    #: --turns all: turns past their conversation's chain end (a re-run ended it earlier): not current, no error
    superseded: list[str] = field(default_factory=list)
    #: agentic jobs: steps whose prompt is not the template's rendering of their history (storage/verify_steps.py)
    step_prompt_mismatch: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    duplicate_rows: int = 0  # rows beyond the first of each duplicated prompt
    malformed: dict[str, list[str]] = field(default_factory=dict)  # prompt_id → problems
    stale: list[str] = field(default_factory=list)  # row content_hash ≠ latest submitted hash
    hash_mismatch: list[str] = field(default_factory=list)  # stored input_ids do not hash to content_hash
    #: committed rows whose ids_crc32 is not the CRC-32 of their input_ids + output_ids (a bit flipped in storage)
    checksum_mismatch: list[str] = field(default_factory=list)
    #: damaged parts moved aside (storage/quarantine.py): their record, plus ``lost`` (prompts it held that are not
    #: stored again; None when unknown) and ``recovered``
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    #: rows of a stale claim (lower epoch than the committed row's): not in the committed view, not an error
    fenced_rows: int = 0
    fenced: list[str] = field(default_factory=list)  # their prompt ids
    #: in the storage manifest but not in Redis's submitted set (Redis lost writes): checked all the same
    unknown_to_redis: list[str] = field(default_factory=list)
    #: done in Redis, no row in storage (a quarantined or deleted part): counted missing
    lost_rows: list[str] = field(default_factory=list)
    permanent_failures: list[str] = field(default_factory=list)  # dead-lettered, no row
    not_submitted: list[str] = field(default_factory=list)
    #: rows expected to reason: the prompt opens reasoning (storage.spans.prompt_opens_reasoning), or the job's
    #: model opens it itself with thinking on (thinkfleet.profiles.expects_reasoning)
    thinking_rows: int = 0
    think_end_rows: int = 0
    reasoning_alarm: bool = False
    #: False: the job runs with --no-reasoning-spans — spans null (not recorded), no reasoning alarm.
    reasoning_spans: bool = True
    per_dataset: dict[str, dict[str, int]] = field(default_factory=dict)
    #: image prompts: distinct images referred to (manifest and rows), and each one missing from the image store,
    #: unreadable or holding other bytes than its sha256 says ("uri (prompt p): why": storage/verify_images.py)
    #: committed rows carrying each quality flag (storage/flags.py): reported, never a failure
    quality_flags: dict[str, int] = field(default_factory=dict)
    images_checked: int = 0
    image_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.missing_turns
            or self.step_prompt_mismatch
            or self.duplicated
            or self.malformed
            or self.stale
            or self.hash_mismatch
            or self.checksum_mismatch
            or self.image_problems
            or any(not q.get("recovered") for q in self.quarantined)
            or self.reasoning_alarm
            or self.submitted_source == "none"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def format_report(report: VerifyReport, limit: int = 20) -> str:
    """Plain text for people: counts, then the first ``limit`` ids of every problem."""
    lines = [
        f"job {report.job}: {'OK' if report.ok else 'FAILED'}",
        f"  submitted {report.submitted} (from {report.submitted_source}), committed {report.committed}, "
        f"stored rows {report.stored_rows}",
        f"  thinking-mode rows {report.thinking_rows}, with </think> {report.think_end_rows}"
        if report.reasoning_spans
        else "  reasoning spans not recorded (--no-reasoning-spans): no reasoning alarm",
    ]
    if report.quality_flags:
        lines.append("  quality flags: " + ", ".join(f"{k} {v}" for k, v in report.quality_flags.items()))
    for name, ds_counts in report.per_dataset.items():
        lines.append(f"  dataset {name}: " + ", ".join(f"{k} {v}" for k, v in ds_counts.items()))
    if report.images_checked:
        bad = len(report.image_problems)
        lines.append(
            f"  images referred to {report.images_checked}, in the image store as hashed {report.images_checked - bad}"
        )

    def section(title: str, ids: list[str], hint: str = "") -> None:
        if not ids:
            return
        lines.append(f"{title}: {len(ids)}{hint}")
        lines.extend(f"  {pid}" for pid in ids[:limit])
        if len(ids) > limit:
            lines.append(f"  … and {len(ids) - limit} more (--json lists all)")

    bad_parts = [q for q in report.quarantined if not q.get("recovered")]
    if bad_parts:
        lines.append(
            f"QUARANTINED PARTS: {len(bad_parts)} (damaged, moved aside under {report.job}/_quarantine/; "
            f"`producer retry {report.job} --missing` or a re-submit of the same inputs regenerates their prompts)"
        )
        for q in bad_parts[:limit]:
            lines.extend(_quarantine_lines(q, limit))
    section(
        "MISSING", report.missing, " (submitted, no row, not dead-lettered: producer retry --missing, or re-submit)"
    )
    section("  of which done in Redis with no row in storage (lost rows)", report.lost_rows)
    missing = set(report.missing)
    section(
        "  of which unknown to Redis (only in the storage manifest)",
        [p for p in report.unknown_to_redis if p in missing],
    )
    if report.missing_turns:
        lines.append(
            f"MISSING TURNS: {len(report.missing_turns)} (--turns all: the previous turn is stored and ended no "
            "chain, this turn was never enqueued)"
        )
        for pid in report.missing_turns[:limit]:
            conv, _, turn = pid.rpartition("/t")
            lines.append(f"  conversation {conv}: turn {turn} ({pid})")
        if len(report.missing_turns) > limit:
            lines.append(f"  … and {len(report.missing_turns) - limit} more (--json lists all)")
    section(
        "STEP PROMPT MISMATCH",
        report.step_prompt_mismatch,
        " (agentic job: the stored prompt is not the template's rendering of the conversation up to the step)",
    )
    section("DUPLICATED", report.duplicated, f" ({report.duplicate_rows} extra rows: producer compact)")
    if report.malformed:
        lines.append(f"MALFORMED: {len(report.malformed)}")
        for pid, problems in list(report.malformed.items())[:limit]:
            lines.append(f"  {pid}: {'; '.join(problems)}")
    section("STALE (row from older prompt content)", report.stale)
    section("HASH MISMATCH (stored input_ids do not hash to the row's content_hash: injected?)", report.hash_mismatch)
    section(
        "CHECKSUM MISMATCH (the row's ids_crc32 is not the CRC-32 of its ids: altered in storage)",
        report.checksum_mismatch,
    )
    section(
        "IMAGE PROBLEMS (a referenced image is not in the image store as its sha256 says; each line: the file, a "
        "prompt that uses it, what is wrong → the fix)",
        report.image_problems,
    )
    if report.reasoning_alarm:
        lines.append(
            f"REASONING ALARM: {report.thinking_rows - report.think_end_rows} of {report.thinking_rows} "
            "thinking-mode outputs have no </think>"
        )
    section("superseded turns (past their conversation's chain end: not current, not exported)", report.superseded)
    if report.fenced_rows:
        lines.append(
            f"fenced: {report.fenced_rows} rows of {len(report.fenced)} prompts (a stale claim's writes, lower epoch "
            "than the committed row: left out of the committed view and of export; producer compact removes them)"
        )
        lines.extend(f"  {pid}" for pid in report.fenced[:limit])
        if len(report.fenced) > limit:
            lines.append(f"  … and {len(report.fenced) - limit} more (--json lists all)")
    recovered = [q for q in report.quarantined if q.get("recovered")]
    if recovered:
        lines.append(f"quarantined parts whose prompts are stored again: {len(recovered)} (inspect, then delete)")
        for q in recovered[:limit]:
            lines.extend(_quarantine_lines(q, limit))
    section("permanent failures (dead-lettered)", report.permanent_failures)
    section("rows not submitted", report.not_submitted)
    lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)


def _quarantine_lines(q: dict[str, Any], limit: int) -> list[str]:
    held, lost = q.get("prompt_ids"), q.get("lost")
    where = q.get("moved_to") or "(not movable: left in place)"
    lines = [f"  {q.get('part')}: {q.get('reason')}", f"    now at {where}"]
    if held is None:
        lines.append("    the prompts it held are unknown (its footer does not decode): see MISSING")
    else:
        shown = ", ".join(held[:limit]) + (f" … and {len(held) - limit} more" if len(held) > limit else "")
        lines.append(f"    held {len(held)} prompts: {shown}")
        if lost:
            lines.append(f"    {len(lost)} of them not stored again")
    return lines
