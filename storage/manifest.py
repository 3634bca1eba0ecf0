"""The submitted set, kept beside the output so it survives losing Redis.

``producer submit`` writes one ``{job}/_manifest/submitted-{utc}-{rand}.parquet`` per submit call
(atomically, like a part), listing every prompt it enqueued. ``verify`` falls back to it when Redis
no longer has the job. A prompt re-submitted with changed content appears again with a new
``content_hash``; the latest submit wins.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout
from storage.reader import first_per_key
from storage.schema import (
    CONTENT_HASH,
    DATASET,
    MANIFEST_SCHEMA,
    PROMPT_ID,
    PROMPT_TOKENS,
    ROW_INDEX,
    SAMPLE_INDEX,
    SUBMITTED_AT,
)

MANIFEST_PREFIX = "submitted-"
_FILE = "__file"


def write_submitted(
    output_uri: str,
    job: str,
    rows: Sequence[Mapping[str, Any]],
    s3_endpoint_url: str | None = None,
) -> str:
    """Record submitted prompts (keys: prompt_id, dataset, row_index, sample_index, content_hash,
    prompt_tokens). Returns the manifest file's URI."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    now = datetime.now(UTC)
    columns = {
        PROMPT_ID: [r[PROMPT_ID] for r in rows],
        DATASET: [r[DATASET] for r in rows],
        ROW_INDEX: [r[ROW_INDEX] for r in rows],
        SAMPLE_INDEX: [r.get(SAMPLE_INDEX, 0) for r in rows],
        CONTENT_HASH: [r[CONTENT_HASH] for r in rows],
        PROMPT_TOKENS: [r.get(PROMPT_TOKENS) for r in rows],
        SUBMITTED_AT: [now] * len(rows),
    }
    table = pa.Table.from_pydict(columns, schema=MANIFEST_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    name = f"{MANIFEST_PREFIX}{layout.utc_stamp(now)}-{uuid.uuid4().hex[:8]}{layout.PARQUET_SUFFIX}"
    path = posixpath.join(loc.manifest_dir(job), name)
    layout.write_atomic(loc, path, memoryview(sink.getvalue()))
    return loc.uri(path)


def read_submitted(output_uri: str, job: str, s3_endpoint_url: str | None = None) -> pa.Table:
    """Every submitted prompt once, with its latest content hash; empty if no manifest exists."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.manifest_dir(job), allow_not_found=True))
    files = sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.startswith(MANIFEST_PREFIX)
        and i.base_name.endswith(layout.PARQUET_SUFFIX)
    )
    if not files:
        return MANIFEST_SCHEMA.empty_table()
    tables = []
    for index, path in enumerate(files):  # one per submit call: few files
        t = ds.dataset(path, schema=MANIFEST_SCHEMA, format="parquet", filesystem=loc.fs).to_table()
        tables.append(t.append_column(_FILE, pa.array(np.full(t.num_rows, index, dtype=np.int32))))
    table = pa.concat_tables(tables)
    # Latest submit wins: newest submitted_at, then the later file (names sort by time).
    latest = first_per_key(table, [(PROMPT_ID, "ascending"), (SUBMITTED_AT, "descending"), (_FILE, "descending")])
    return table.take(latest).drop([_FILE])
