"""``--format eagle3``: token-level records, Parquet (or JSONL when ``--out`` ends in ``.jsonl``).

A record is ``id``, ``dataset``, ``input_ids`` = prompt + output, ``loss_mask`` 1 over the output and 0 over
the prompt, ``prompt_len``, ``finish_reason`` (:data:`~storage.exports.tokens.EAGLE3_SCHEMA`). The Parquet is for
a loader of your own: neither SpecForge nor speculators reads Parquet (SpecForge's prompt builder reads any file
as JSON lines and fails on it). The JSONL form is what they read (see :mod:`storage.exports.specforge`, which
writes it through this class).
``exclude_reasoning`` zeroes the mask over the reasoning block (through ``</think>``); a job run with
``--no-reasoning-spans`` trains on the whole output. Rows longer than SpecForge's default ``data.max_length``
(or ``--max-length``) are counted and warned about, by id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import ClassVar

import pyarrow as pa

from storage import layout
from storage.exports.base import (
    COLUMNS,
    SPECFORGE_MAX_LENGTH,
    SPECULATORS_SEQ_LENGTH,
    ExportFormat,
    ExportResult,
    Files,
    LengthCheck,
    Rows,
)
from storage.exports.tokens import EAGLE3_SCHEMA, MERGE_COLUMNS, eagle3_table, merged_table


class Eagle3(ExportFormat):
    name = "eagle3"
    suffix = ".parquet"
    merges_turns = True
    length_limit = SPECFORGE_MAX_LENGTH
    length_advice = (
        f"SpecForge cuts rows at data.max_length (default {SPECFORGE_MAX_LENGTH}) without a warning and speculators "
        f"at --seq-length (default {SPECULATORS_SEQ_LENGTH}): set data.max_length={{longest}} / --seq-length "
        "{longest}, or these rows lose their tail"
    )
    #: The fields of a JSONL record (``None``: every column of the records).
    jsonl_fields: ClassVar[tuple[str, ...] | None] = None

    def writes_parquet(self, loc: layout.Location) -> bool:
        return not loc.root.endswith(".jsonl")

    def keep(self, records: pa.Table, skipped: dict[str, int]) -> pa.Table:
        """The records worth writing (a subclass drops, and counts into ``skipped``, what its readers drop)."""
        return records

    #: Stored columns a subclass's :meth:`keep_rows` reads besides the records' own.
    row_columns: ClassVar[tuple[str, ...]] = ()

    def keep_rows(self, table: pa.Table, skipped: dict[str, int]) -> pa.Table:
        """The stored rows worth making records of (a subclass drops, and counts, rows its readers cannot take)."""
        return table

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        opts = self.options
        parquet = self.writes_parquet(loc)
        suffix = ".parquet" if parquet else ".jsonl"
        lengths = LengthCheck(self.max_length)
        columns = [*(MERGE_COLUMNS if opts.merge_turns else COLUMNS), *self.row_columns]
        # A row group is held, joined into one table and encoded: about three times this share at once.
        with Files(loc, suffix, opts.shard_rows, result, EAGLE3_SCHEMA, rows.memory_bytes // 16) as files:
            for _, tables in rows.dataset_tables(columns, merge_turns=opts.merge_turns):
                for table in tables:
                    table = self.keep_rows(table, result.skipped)
                    if opts.merge_turns:
                        records = merged_table(table, opts.exclude_reasoning, result.skipped)
                    else:
                        records = eagle3_table(table, opts.exclude_reasoning)
                    records = self.keep(records, result.skipped)
                    lengths.add_records(records)
                    if parquet:
                        files.write_table(records)
                    else:
                        fields = list(self.jsonl_fields or records.column_names)
                        files.write_lines(_json_lines(records.select(fields)))
                files.end_table()  # a dataset's rows are one row group, as when a dataset was read whole
        lengths.report(result, self.length_advice)


#: Rows turned into Python objects at once for JSON (an id is ~36 bytes as a Python int, 4 in Arrow).
_JSON_SLICE_ROWS = 1024


def _json_lines(table: pa.Table) -> Iterator[str]:
    for start in range(0, table.num_rows, _JSON_SLICE_ROWS):
        for record in table.slice(start, _JSON_SLICE_ROWS).to_pylist():
            yield json.dumps(record, separators=(",", ":"))
