"""``producer verify JOB``: is every submitted prompt in storage exactly once, and is every row sound?

Failing (non-zero exit): a submitted prompt with no row and no dead letter (missing); a prompt with
more than one row at its winning revision (duplicated — run ``producer compact``, which keeps the
committed winner); a row whose spans or counts contradict its ids (malformed); a row generated from
other prompt content than the latest submit (stale); a row whose stored ``input_ids`` do not hash to
its ``content_hash`` (hash mismatch: injected or corrupted — the hash is recomputed here, never taken
from the message); the seed's bug — thinking prompts whose
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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import jobstate, layout, quarantine, reader, stream
from storage.chains import CHAIN_COLUMNS, RecordReader, redis_records, stored_links
from storage.checks import CHECK_COLUMNS, ThinkingStats, flat_ids, row_problems
from storage.manifest import read_submitted
from storage.schema import (
    CONTENT_HASH,
    DATASET,
    IDS_CRC32,
    INPUT_IDS,
    MANIFEST_SCHEMA,
    PROMPT_ID,
    TOOL_CALL_SPANS,
    table_ids_checksums,
)
from thinkfleet import profiles
from thinkfleet.chain_end import owed_successors
from thinkfleet.message import hash_id_bytes, is_content_hash
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.tokens import SpanTokens
from thinkfleet.turns import beyond_chain_ends


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
            or any(not q.get("recovered") for q in self.quarantined)
            or self.reasoning_alarm
            or self.submitted_source == "none"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


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
            checked = _check_rows(plan, tokens, expected, submitted)
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
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
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
_ROW_COLUMNS = [*CHECK_COLUMNS, CONTENT_HASH, IDS_CRC32]


@dataclass
class _RowChecks:
    """What the per-row checks found over the committed rows (any order)."""

    malformed: dict[str, list[str]] = field(default_factory=dict)
    thinking: ThinkingStats = field(default_factory=ThinkingStats)
    hash_mismatch: list[str] = field(default_factory=list)
    checksum_mismatch: list[str] = field(default_factory=list)
    tool_rows: set[str] = field(default_factory=set)  # multi-turn rows whose output calls a tool (a chain end)


def _check_rows(plan: stream.Plan, tokens: SpanTokens, expected: bool, submitted: pa.Table) -> _RowChecks:
    """Every committed row's checks, a batch of rows at a time; raises ``stream.PlanStale``."""
    out = _RowChecks()
    for table in stream.winner_batches(plan, _ROW_COLUMNS):
        problems, stats = row_problems(table, tokens, expected)
        out.malformed.update(problems)
        out.thinking.add(stats)
        out.hash_mismatch.extend(hash_mismatches(table, _submitted_hashes(table, submitted)))
        out.checksum_mismatch.extend(checksum_mismatches(table))
        calls = pc.list_value_length(table[TOOL_CALL_SPANS]).to_numpy(zero_copy_only=False) > 0
        if calls.any():
            pids = table[PROMPT_ID].to_pylist()
            out.tool_rows.update(pids[i] for i in np.flatnonzero(calls).tolist())
    return out


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


def checksum_mismatches(table: pa.Table) -> list[str]:
    """Prompt ids of rows whose ``ids_crc32`` is not the CRC-32 of their ids (rows without one — written before
    schema 6 — are not checked)."""
    if IDS_CRC32 not in table.column_names or table.num_rows == 0:
        return []
    stored = table[IDS_CRC32]
    valid = stored.is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return []
    differ = valid & (stored.fill_null(0).to_numpy() != table_ids_checksums(table))
    pids = table[PROMPT_ID].to_pylist()
    return [pids[i] for i in differ.nonzero()[0].tolist()]


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
            client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
            with client:
                return redis_records(client, settings.keys.turn_answers(job))(prompt_ids)
        except (redis.RedisError, OSError):
            return {}

    return read


def _chain_ends(settings: Settings, job: str) -> set[str] | None:
    """Turn prompt ids whose answer record (``Keys.turn_answers``) says ``chain_end``; None: Redis
    could not be read."""
    import json

    import redis

    key = settings.keys.turn_answers(job)
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        with client:
            ends = set()
            for pid, raw in client.hscan_iter(key, count=1000):
                if b"chain_end" in raw:
                    try:
                        if "chain_end" in json.loads(raw):
                            ends.add(pid.decode())
                    except ValueError:
                        continue
            return ends
    except (redis.RedisError, OSError):
        return None


def hash_mismatches(table: pa.Table, submitted: dict[str, str] | None = None) -> list[str]:
    """Prompt ids of rows whose ``input_ids`` do not hash to their ``content_hash`` — or, for a row whose
    hash is no :func:`thinkfleet.message.content_hash` (empty, a placeholder), to the hash submitted for
    the prompt (``submitted``: prompt_id → hash). Placeholders on both sides (the test fleet's
    ``h-<prompt>``) cannot be recomputed; the stale check compares them as text.
    """
    submitted = submitted or {}
    hashes = table[CONTENT_HASH].to_pylist()
    values, offsets = flat_ids(table[INPUT_IDS])
    ids = values.astype("<u4", copy=False)
    out = []
    for i, (pid, stored) in enumerate(zip(table[PROMPT_ID].to_pylist(), hashes, strict=True)):
        wanted = stored if is_content_hash(stored) else submitted.get(pid)
        if is_content_hash(wanted) and hash_id_bytes(ids[offsets[i] : offsets[i + 1]].tobytes()) != wanted:
            out.append(pid)
    return out


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
    for name, ds_counts in report.per_dataset.items():
        lines.append(f"  dataset {name}: " + ", ".join(f"{k} {v}" for k, v in ds_counts.items()))

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


# -- producer verify JOB --live: the invariant while the job runs ----------------------------------------------
@dataclass
class LiveReport:
    """``total = done + dead + queued + running`` checked against Redis now (``thinkfleet.state.invariant``)."""

    job: str
    counts: dict[str, int] = field(default_factory=dict)
    unaccounted: list[str] = field(default_factory=list)
    duplicated: int = 0  # finished prompts with a message still queued or delivered: a redelivery, fine
    error: str = ""  # why the invariant could not be checked (no job, Redis unreachable, RabbitMQ broker)

    @property
    def ok(self) -> bool:
        return not (self.unaccounted or self.error)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_live(settings: Settings, job: str) -> LiveReport:
    """Every submitted prompt of ``job`` is done, dead-lettered, queued or running — right now."""
    import redis

    from thinkfleet.state.invariant import NotObservable, account

    report = LiveReport(job=job)
    client = redis.Redis.from_url(settings.redis_url)
    try:
        if not client.exists(settings.keys.prompts(job)):
            report.error = f"job {job!r} has no submitted prompts in Redis at {_redacted(settings.redis_url)}"
            return report
        acc = account(client, settings, job)
    except NotObservable as exc:
        report.error = f"{exc}; --live needs a Redis broker"
        return report
    except redis.RedisError as exc:
        report.error = f"cannot reach Redis at {_redacted(settings.redis_url)}: {exc}"
        return report
    finally:
        client.close()
    report.counts = acc.counts()
    # Turns a re-run no longer derives (past their chain end) left done for good: superseded, not unaccounted.
    from storage.verify_steps import unreachable_steps

    gone = beyond_chain_ends(acc.unaccounted, _chain_ends(settings, job) or set())
    gone |= unreachable_steps(settings, job, acc.unaccounted)  # agentic: steps no current chain reaches
    report.unaccounted = sorted(set(acc.unaccounted) - gone)
    if gone:
        report.counts["unaccounted"] -= len(gone)
        report.counts["superseded"] = len(gone)
    report.duplicated = len(acc.duplicated)
    return report


def format_live_report(report: LiveReport, limit: int = 20) -> str:
    if report.error:
        return f"job {report.job} (live): CANNOT CHECK — {report.error}"
    c = report.counts
    lines = [
        f"job {report.job} (live): {'OK' if report.ok else 'FAILED'}",
        f"  total {c['total']} = done {c['done']} + dead {c['dead']} + queued {c['queued']} + running "
        f"{c['running']}"
        + (f" + superseded {c['superseded']}" if c.get("superseded") else "")
        + (f" + UNACCOUNTED {c['unaccounted']}" if c["unaccounted"] else ""),
    ]
    if report.duplicated:
        lines.append(f"  {report.duplicated} finished prompt(s) still have a message queued or delivered (redelivery)")
    if report.unaccounted:
        lines.append(
            f"UNACCOUNTED: {len(report.unaccounted)} (not stored, not dead-lettered, not queued, not running: "
            "nothing will run them; producer submit re-enqueues them)"
        )
        lines.extend(f"  {pid}" for pid in report.unaccounted[:limit])
        if len(report.unaccounted) > limit:
            lines.append(f"  … and {len(report.unaccounted) - limit} more (--json lists all)")
    return "\n".join(lines)


def _redacted(url: str) -> str:
    """``redis://:secret@host`` → ``redis://:**@host``: passwords never reach output."""
    import re

    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1**@", url)
