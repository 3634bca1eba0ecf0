"""``producer verify JOB``: is every submitted prompt in storage exactly once, and is every row sound?

Failing (non-zero exit): a submitted prompt with no row and no dead letter (missing); a prompt with
more than one row at its winning revision (duplicated — run ``producer compact``, which keeps the
committed winner); a row whose spans or counts contradict its ids (malformed); a row generated from
other prompt content than the latest submit (stale); a row whose stored ``input_ids`` do not hash to
its ``content_hash`` (hash mismatch: injected or corrupted — the hash is recomputed, storage/checks.py, never
taken from the message); the seed's bug — thinking prompts whose
outputs almost never close reasoning (reasoning alarm); or no submitted set to check against.

Multi-turn jobs (``--turns all``): a later turn joins the submitted set only when a worker enqueues it, so a
chain that stopped without its turn being enqueued is checked from the stored rows (storage/chains.py, the rule
of thinkfleet/chain_end.py that ``producer wait`` confirms too): each conversation's chain is walked from turn 0
along its committed rows — each row's ``chain_end`` says whether it goes on (to its next step or turn) or ends
(complete, or a reason); rows written before that column are judged by their Redis answer record — and a chain
whose last stored row goes on to a prompt that is neither submitted nor dead-lettered fails (``missing_turns``).
A chain that ended with a recorded reason is never flagged. A turn past
its conversation's earliest chain end (a re-run of an earlier turn now calls a tool: ``producer retry
--truncated``) is *superseded* (``thinkfleet.turns.beyond_chain_ends``): listed, neither missing nor an error,
and ``export`` skips its row.

Damaged storage (storage/quarantine.py): every column of every part is decoded first with its Parquet page
checksums verified, and a part that does not decode is quarantined; a quarantined part whose prompts are not all
stored again fails (``quarantined``, each named with the prompts it held when its footer still says), as does a
committed row whose ``ids_crc32`` is not the CRC-32 of its ids (``checksum_mismatch``; rows older than schema 6
have none). The submitted set is Redis's *and* the storage manifest's: a prompt the manifest lists but Redis does
not know (Redis lost writes) with no row is missing, and so is a prompt Redis calls done that has no row
(``lost_rows``: a quarantined or deleted part) — ``producer retry --missing`` or a re-submit regenerates them.

Reported without failing: dead-lettered prompts with no row ("permanent failures", retried with
``producer retry``), rows whose prompt_id was never submitted, and fenced rows (a stale claim's writes, of a
lower epoch than the committed row's: left out of the committed view; ``producer compact`` removes them).

This module gathers the job's sets and walks its rows; the findings and their text are storage/verify_report.py's,
the row-level checks storage/checks.py's, the agentic steps' storage/verify_steps.py's, and ``--live`` (Redis only,
while the job runs) storage/verify_live.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import jobstate, layout, quarantine, reader, stream
from storage.chains import CHAIN_COLUMNS, RecordReader, redis_records, stored_links
from storage.checks import (
    CHECK_COLUMNS,
    IMAGE_CHECK_COLUMNS,
    ThinkingStats,
    checksum_mismatches,
    hash_mismatches,
    image_problems,
    row_problems,
)
from storage.flags import FLAG_NAMES, FLAG_READ_COLUMNS, count_flags, table_flags
from storage.manifest import read_submitted
from storage.schema import (
    CONTENT_HASH,
    DATASET,
    IDS_CRC32,
    MANIFEST_SCHEMA,
    PROMPT_ID,
    TOOL_CALL_SPANS,
)
from storage.verify_images import ImageRefs, check_images, manifest_images, row_images
from storage.verify_report import VerifyReport
from thinkfleet import profiles
from thinkfleet.chain_end import owed_successors
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.tokens import SpanTokens
from thinkfleet.turns import beyond_chain_ends


def verify_job(settings: Settings, job: str) -> VerifyReport:
    """Check ``job`` under ``settings.output_uri`` against its submitted set (Redis, else manifest)."""
    uri, endpoint = settings.output_uri, settings.s3_endpoint_url
    state = jobstate.load_job_state(settings, job)
    report = VerifyReport(job=job, submitted_source="none")
    if not state.redis_ok:
        report.notes.append(f"Redis unreachable ({state.error}); dead letters unknown")

    loc = layout.locate(uri, endpoint)
    try:
        manifest = read_submitted(uri, job, endpoint)
    except (pa.ArrowException, OSError, ValueError) as exc:  # a damaged manifest file: say so, check without it
        manifest = MANIFEST_SCHEMA.empty_table()
        report.notes.append(f"the storage manifest of {job} cannot be read ({type(exc).__name__}: {exc})")
    # The prompt sets are Arrow arrays (a few bytes a prompt, membership by pc.is_in), not Python sets and dicts
    # (~100 bytes a prompt each): at a million prompts that is the difference between MBs and GBs.
    submitted, sub_dataset = _submitted(state, manifest, report)
    state.submitted, state.prompt_dataset = {}, {}

    # The keys of every stored row, then the committed rows' columns batch by batch (storage/stream.py): memory
    # stays within the storage_memory_mb setting whatever the job's size.
    tokens = jobstate.span_tokens(state.record)
    expected = _reasoning_expected(state.record, tokens)
    # The first pass decodes every column of every part, page checksums verified (reader.check_parts in the same
    # read): damaged ones are quarantined before anything is counted.
    damaged: list[str] = []
    for attempt in range(stream.REPLANS):
        plan = stream.plan(
            loc, job, None, _KEY_COLUMNS, columns=_ROW_COLUMNS, memory_bytes=stream.memory_bytes_of(settings),
            check_all=True,
        )  # fmt: skip
        damaged += plan.damaged
        try:
            checked = _check_rows(plan, tokens, expected, submitted, _placeholder_id(state.record))
            break
        except stream.PlanStale:  # a part changed under the read (a compaction): read the job again
            if attempt == stream.REPLANS - 1:
                raise
    keys = plan.tagged()
    report.stored_rows = keys.num_rows
    dups = reader.duplicate_rows(keys)
    dup_counts = Counter(dups[PROMPT_ID].to_pylist())
    report.duplicated = sorted(dup_counts)
    report.duplicate_rows = sum(dup_counts.values()) - len(dup_counts)
    fenced = reader.fenced_rows(keys)
    report.fenced_rows = fenced.num_rows
    report.fenced = sorted(set(fenced[PROMPT_ID].to_pylist()))
    del keys, dups, fenced

    winners = plan.winners
    stored = _ids(winners[PROMPT_ID])  # one committed row per prompt: distinct
    report.committed = len(stored)
    report.submitted = len(submitted[PROMPT_ID])

    dead = _ids(list(state.dead))
    done = _done_ids(settings, job) if state.redis_ok else None
    lost = _minus(done, stored) if done is not None else _ids([])
    report.lost_rows = _sorted_list(lost)
    sub_ids = _ids(submitted[PROMPT_ID])
    if report.submitted_source != "none":
        report.missing = _sorted_list(_minus(_minus(_ids(pa.chunked_array([sub_ids, lost]).unique()), stored), dead))
        report.not_submitted = _sorted_list(_minus(stored, sub_ids))
        report.stale = _stale(winners, submitted)
    report.permanent_failures = _sorted_list(_minus(dead, stored))
    del done, lost

    malformed, thinking, tool_rows = checked.malformed, checked.thinking, checked.tool_rows
    # In the order a dataset-by-dataset read in prompt_id order gave (the text report lists the first ones).
    if malformed:  # (a dict of every prompt's dataset only when some row is malformed)
        bad = winners.filter(pc.is_in(winners[PROMPT_ID], pa.array(list(malformed), pa.string())))
        dataset_of = dict(zip(bad[PROMPT_ID].to_pylist(), bad[DATASET].to_pylist(), strict=True))
        report.malformed = {p: malformed[p] for p in sorted(malformed, key=lambda p: (str(dataset_of.get(p)), p))}
    report.hash_mismatch = sorted(checked.hash_mismatch)
    report.checksum_mismatch = sorted(checked.checksum_mismatch)
    # Where each conversation's chain stands, from the rows themselves (their chain_end column: storage/chains.py;
    # Redis' answer records only for rows written before it): the same rule `producer wait` confirms.
    convs, links = stored_links(winners, tool_rows, _answer_records(settings, job) if state.redis_ok else None)
    chain_ends = {pid for pid, link in links.items() if link.ends}
    # (no chain end: nothing is superseded, and the ids need not be walked)
    superseded = beyond_chain_ends(_walk(stored, sub_ids), chain_ends) if chain_ends else set()
    steps = None
    if state.redis_ok:  # agentic jobs: steps no current chain reaches are superseded too (storage/verify_steps.py)
        from storage.verify_steps import check_steps

        steps = check_steps(settings, job, _walk(stored, sub_ids))  # (walked only for an agentic job)
        superseded |= steps.stale
    report.superseded = sorted(superseded)
    report.missing = [pid for pid in report.missing if pid not in superseded]
    # (a superseded turn also left the submitted set — finalize.lua drops it — so it is listed once, as superseded)
    report.not_submitted = [pid for pid in report.not_submitted if pid not in superseded]
    if convs:
        # --turns all: a chain whose last stored row goes on to a prompt nobody submitted or dead-lettered stopped
        # without a reason (a submitted one with no row is MISSING above).
        report.missing_turns = sorted(owed_successors(convs, links, _known(sub_ids, state.dead)).values())
    if steps is not None:
        report.step_prompt_mismatch = steps.mismatches
        report.notes.extend([steps.note] if steps.note else [])
    report.thinking_rows, report.think_end_rows = thinking.thinking_rows, thinking.think_end_rows
    report.quality_flags = dict(checked.flags)
    report.reasoning_spans = tokens.reasoning_spans
    if tokens.reasoning_spans:
        _reasoning_alarm(report, settings)
    else:
        report.notes.append(
            "the job runs without reasoning spans (--no-reasoning-spans): its rows' reasoning/answer spans are null "
            "(not recorded) and the reasoning alarm is off"
        )
    report.per_dataset = _per_dataset(report, sub_dataset, winners)
    report.quarantined = _quarantined(loc, job, damaged, stored, report)
    # Image prompts: every image the submitted conversations and the rows refer to, read back and hashed.
    images = checked.images
    manifest_images(loc, job, images)
    found = check_images(images, endpoint)
    report.images_checked, report.image_problems = found.checked, found.problems
    return report


# -- prompt id sets as Arrow arrays ---------------------------------------------------------------------------
def _ids(values: Any) -> pa.Array:
    """Prompt ids (a list, an Arrow array or chunked array) as one string array."""
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if isinstance(values, pa.Array):
        return values
    return pa.array(values, pa.string())


def _minus(ids: pa.Array, other: pa.Array) -> pa.Array:
    """The ids of ``ids`` not in ``other`` (its hash table is built over ``other``: Arrow memory, not objects)."""
    if len(ids) == 0 or len(other) == 0:
        return ids
    return ids.filter(pc.invert(pc.is_in(ids, value_set=other)))


def _sorted_list(ids: pa.Array) -> list[str]:
    """``sorted(set(ids))``: Arrow sorts strings by their UTF-8 bytes, which is code point order, as Python does."""
    unique = ids.unique()
    return unique.take(pc.array_sort_indices(unique)).to_pylist()


def _walk(*arrays: pa.Array, step: int = 1 << 16) -> Iterator[str]:
    """The ids of ``arrays`` as Python strings, a slice at a time (never all of them at once)."""
    for array in arrays:
        for start in range(0, len(array), step):
            yield from array.slice(start, step).to_pylist()


#: The submitted set, and the dataset of each submitted prompt (verify's own tables; prompt ids distinct).
_SUBMITTED = pa.schema([(PROMPT_ID, pa.string()), (CONTENT_HASH, pa.string())])
_DATASET_OF = pa.schema([(PROMPT_ID, pa.string()), (DATASET, pa.string())])


def _submitted(state: jobstate.JobState, manifest: pa.Table, report: VerifyReport) -> tuple[pa.Table, pa.Table]:
    """The submitted set (Redis's, plus what only the storage manifest lists; else the manifest's) and the
    dataset of each prompt, as :data:`_SUBMITTED` and :data:`_DATASET_OF` tables."""
    if state.submitted:
        report.submitted_source = "redis"
        submitted = pa.table([list(state.submitted), list(state.submitted.values())], schema=_SUBMITTED)
        datasets = pa.table([list(state.prompt_dataset), list(state.prompt_dataset.values())], schema=_DATASET_OF)
        unknown = manifest.filter(pc.invert(pc.is_in(manifest[PROMPT_ID], value_set=_ids(submitted[PROMPT_ID]))))
        if unknown.num_rows:  # Redis lost writes (or the job was purged and re-submitted with other prompts)
            submitted = pa.concat_tables([submitted, unknown.select(_SUBMITTED.names).cast(_SUBMITTED)])
            known = pc.is_in(unknown[PROMPT_ID], value_set=_ids(datasets[PROMPT_ID]))
            datasets = pa.concat_tables(
                [datasets, unknown.filter(pc.invert(known)).select(_DATASET_OF.names).cast(_DATASET_OF)]
            )
            report.unknown_to_redis = _sorted_list(_ids(unknown[PROMPT_ID]))
            report.notes.append(
                f"{unknown.num_rows} prompts of the storage manifest are not in Redis's submitted set (Redis lost "
                "writes? or a purge and a re-submit with other prompts): checked all the same"
            )
        return submitted, datasets
    if manifest.num_rows:
        report.submitted_source = "manifest"
        return manifest.select(_SUBMITTED.names).cast(_SUBMITTED), manifest.select(_DATASET_OF.names).cast(_DATASET_OF)
    report.notes.append("no submitted set in Redis or in the storage manifest: nothing to check against")
    return _SUBMITTED.empty_table(), _DATASET_OF.empty_table()


def _lookup(ids: pa.Array, table: pa.Table, column: str) -> pa.Array:
    """``table[column]`` of each id (by ``table``'s prompt_id; null where it has none)."""
    at = pc.index_in(ids, value_set=_ids(table[PROMPT_ID]))
    return _ids(table[column]).take(at)


def _stale(winners: pa.Table, submitted: pa.Table) -> list[str]:
    """Committed rows whose content hash is not the latest submitted one (both set and non-empty)."""
    stored = _ids(winners[CONTENT_HASH]).fill_null("")
    wanted = _lookup(_ids(winners[PROMPT_ID]), submitted, CONTENT_HASH).fill_null("")
    stale = pc.and_(pc.and_(pc.not_equal(stored, ""), pc.not_equal(wanted, "")), pc.not_equal(stored, wanted))
    return _sorted_list(_ids(winners[PROMPT_ID]).filter(stale))


def _submitted_hashes(table: pa.Table, submitted: pa.Table) -> dict[str, str]:
    """prompt_id → submitted hash of the rows of ``table`` whose own hash is no content hash (the only rows
    :func:`hash_mismatches` looks the submitted one up for)."""
    own = _ids(table[CONTENT_HASH])
    real = pc.fill_null(pc.match_substring_regex(own, r"^[0-9a-f]{16}$"), False)
    if pc.all(real).as_py():  # (every row's own hash is checked: the common case)
        return {}
    need = _ids(table[PROMPT_ID]).filter(pc.invert(real))
    hashes = _lookup(need, submitted, CONTENT_HASH)
    return {p: h for p, h in zip(need.to_pylist(), hashes.to_pylist(), strict=True) if h is not None}


def _done_ids(settings: Settings, job: str) -> pa.Array | None:
    """Redis's done set of ``job`` as distinct ids; None when Redis cannot be read."""
    import redis

    chunks: list[pa.Array] = []
    batch: list[bytes] = []
    try:
        client = sync_client(settings.redis_url, timeout_s=5)
        with client:
            for member in client.sscan_iter(settings.keys.done(job), count=5000):
                batch.append(member)
                if len(batch) >= 1 << 16:
                    chunks.append(pa.array(batch, pa.binary()).cast(pa.string()))
                    batch = []
    except (redis.RedisError, OSError):
        return None
    chunks.append(pa.array(batch, pa.binary()).cast(pa.string()))
    return _ids(pa.chunked_array(chunks, pa.string()).unique())  # SSCAN may return a member twice


_KEY_COLUMNS = list(dict.fromkeys([DATASET, CONTENT_HASH, *CHAIN_COLUMNS]))
_ROW_COLUMNS = list(dict.fromkeys([*CHECK_COLUMNS, CONTENT_HASH, IDS_CRC32, *IMAGE_CHECK_COLUMNS, *FLAG_READ_COLUMNS]))


@dataclass
class _RowChecks:
    """What the per-row checks found over the committed rows (any order)."""

    malformed: dict[str, list[str]] = field(default_factory=dict)
    thinking: ThinkingStats = field(default_factory=ThinkingStats)
    hash_mismatch: list[str] = field(default_factory=list)
    checksum_mismatch: list[str] = field(default_factory=list)
    tool_rows: set[str] = field(default_factory=set)  # multi-turn rows whose output calls a tool (a chain end)
    images: ImageRefs = field(default_factory=ImageRefs)  # image prompts: each image the rows refer to
    flags: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FLAG_NAMES, 0))  # rows per quality flag


def _check_rows(
    plan: stream.Plan, tokens: SpanTokens, expected: bool, submitted: pa.Table, placeholder_id: int | None = None
) -> _RowChecks:
    """Every committed row's checks, a batch of rows at a time; raises ``stream.PlanStale``."""
    out = _RowChecks()
    for table in stream.winner_batches(plan, _ROW_COLUMNS):
        problems, stats = row_problems(table, tokens, expected)
        out.malformed.update(problems)
        for pid, found in image_problems(table, placeholder_id).items():  # image prompts: their placeholders
            out.malformed.setdefault(pid, []).extend(found)
        out.thinking.add(stats)
        for name, count in count_flags(table_flags(table, tokens)).items():
            out.flags[name] += count
        out.hash_mismatch.extend(hash_mismatches(table, _submitted_hashes(table, submitted)))
        out.checksum_mismatch.extend(checksum_mismatches(table))
        row_images(out.images, table)
        calls = pc.list_value_length(table[TOOL_CALL_SPANS]).to_numpy(zero_copy_only=False) > 0
        if calls.any():
            pids = table[PROMPT_ID].to_pylist()
            out.tool_rows.update(pids[i] for i in np.flatnonzero(calls).tolist())
    return out


def _placeholder_id(record: dict[str, Any]) -> int | None:
    """The image placeholder id the job record names (``producer submit`` writes it once it read an image)."""
    value = record.get("image_placeholder_id")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _quarantined(
    loc: layout.Location, job: str, damaged: list[str], stored: pa.Array, report: VerifyReport
) -> list[dict[str, Any]]:
    """The job's quarantined parts — and those found damaged now that could not be moved aside — each with
    ``lost`` (the prompts it held that have no committed row now; None when its footer no longer says which) and
    ``recovered`` (all stored again; for a part whose prompts are unknown: no submitted prompt is missing)."""
    records = quarantine.list_quarantined(loc, job)
    listed = {r.get("part") for r in records}
    for part in damaged:
        if part not in listed:
            records.append(quarantine.found_here(part) or {"part": part, "reason": "damaged", "prompt_ids": None})
    out = []
    for record in records:
        held = record.get("prompt_ids")
        if held is not None:
            record["lost"] = _sorted_list(_minus(_ids(list(held)), stored))
            record["recovered"] = not record["lost"]
        else:
            record["lost"] = None
            record["recovered"] = report.submitted_source != "none" and not report.missing
        out.append(record)
    return out


def _known(submitted: pa.Array, dead: Any) -> Any:
    """:func:`thinkfleet.chain_end.owed_successors`'s ``present``: the candidates submitted or dead-lettered."""

    def present(prompt_ids: list[str]) -> list[str]:
        ids = _ids(prompt_ids)
        known = ids.filter(pc.is_in(ids, value_set=submitted)).to_pylist() if len(submitted) else []
        return known + [pid for pid in prompt_ids if pid in dead]

    return present


def _answer_records(settings: Settings, job: str) -> RecordReader:
    """Redis' answer records of the rows written before ``chain_end`` (none when Redis does not answer)."""
    import redis

    def read(prompt_ids: list[str]) -> dict[str, dict[str, Any]]:
        try:
            client = sync_client(settings.redis_url, timeout_s=5)
            with client:
                return redis_records(client, settings.keys.turn_answers(job))(prompt_ids)
        except (redis.RedisError, OSError):
            return {}

    return read


def _reasoning_expected(record: dict[str, Any] | JobRecord, tokens: SpanTokens) -> bool:
    """Every row of the job should reason (its model opens reasoning itself and its kwargs leave thinking on:
    :func:`thinkfleet.profiles.expects_reasoning`); a record without a family is a Kimi job (prompts decide)."""
    if not isinstance(record, JobRecord):
        record = JobRecord.from_dict(record)
    family = record.model_family or profiles.LEGACY_FAMILY
    return profiles.expects_reasoning(family, record.chat_template_kwargs, tokens.reasoning_spans)


def _reasoning_alarm(report: VerifyReport, settings: Settings) -> None:
    """The seed's bug: rows expected to reason (the prompt opened reasoning, or thinking is on for a model that
    opens it itself) whose outputs never close it."""
    rows, closed = report.thinking_rows, report.think_end_rows
    if rows and closed == 0:
        report.notes.append(
            f"no </think> in any of {rows} thinking-mode outputs: reasoning may be lost or cut off "
            "(max_new_tokens too small? wrong think-end id?)"
        )
    if rows >= settings.alarm_min_rows and (rows - closed) / rows >= settings.alarm_missing_share:
        report.reasoning_alarm = True


def _per_dataset(report: VerifyReport, sub_dataset: pa.Table, winners: pa.Table) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}

    def count(datasets: pa.Array, key: str) -> None:
        for item in pc.value_counts(datasets.cast(pa.string())).to_pylist():  # (a null dataset is counted too)
            entry = out.setdefault(item["values"] or "?", {"submitted": 0, "committed": 0, "missing": 0, "dead": 0})
            entry[key] += item["counts"]

    count(_ids(sub_dataset[DATASET]), "submitted")
    count(_ids(winners[DATASET]), "committed")
    count(_lookup(_ids(report.missing), sub_dataset, DATASET), "missing")
    count(_lookup(_ids(report.permanent_failures), sub_dataset, DATASET), "dead")
    return dict(sorted(out.items()))
