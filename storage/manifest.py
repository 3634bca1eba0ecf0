"""The submitted set, kept beside the output so it survives losing Redis.

``producer submit`` writes one ``{job}/_manifest/submitted-{utc}-{rand}.parquet`` per submit call
(atomically, like a part), listing every prompt it enqueued. ``verify`` falls back to it when Redis
no longer has the job. A prompt re-submitted with changed content appears again with a new
``content_hash``; the latest submit wins.

Each row also keeps the prompt's SOURCE conversation — the cleaned ``messages`` and ``tools`` the chat
template rendered, as JSON text (:data:`SOURCE_SCHEMA`) — so ``producer export --format messages`` can
write the conversation as the dataset had it instead of re-parsing rendered ids. Manifests written
before these columns existed read back with them null; re-running the same ``producer submit`` writes
a new manifest with them (it enqueues nothing that is done).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
#: Source-conversation columns (JSON text; null when the submit did not record them).
SOURCE_MESSAGES = "messages"
SOURCE_TOOLS = "tools"
SOURCE_SCHEMA = MANIFEST_SCHEMA.append(pa.field(SOURCE_MESSAGES, pa.large_string())).append(
    pa.field(SOURCE_TOOLS, pa.large_string())
)


def write_submitted(
    output_uri: str,
    job: str,
    rows: Sequence[Mapping[str, Any]],
    s3_endpoint_url: str | None = None,
) -> str:
    """Record submitted prompts (keys: prompt_id, dataset, row_index, sample_index, content_hash,
    prompt_tokens, and optionally ``messages``/``tools``: the source conversation as the chat template
    got it). Returns the manifest file's URI."""
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
        SOURCE_MESSAGES: [_json_text(r.get(SOURCE_MESSAGES)) for r in rows],
        SOURCE_TOOLS: [_json_text(r.get(SOURCE_TOOLS)) for r in rows],
    }
    table = pa.Table.from_pydict(columns, schema=SOURCE_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    name = f"{MANIFEST_PREFIX}{layout.utc_stamp(now)}-{uuid.uuid4().hex[:8]}{layout.PARQUET_SUFFIX}"
    path = posixpath.join(loc.manifest_dir(job), name)
    layout.write_atomic(loc, path, memoryview(sink.getvalue()))
    return loc.uri(path)


def read_submitted(output_uri: str, job: str, s3_endpoint_url: str | None = None) -> pa.Table:
    """Every submitted prompt once, with its latest content hash; empty if no manifest exists."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    files = _manifest_files(loc, job)
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


def read_sources(
    output_uri: str, job: str, datasets: Sequence[str] | None = None, s3_endpoint_url: str | None = None
) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    """(prompt_id, content_hash) → (messages JSON, tools JSON) of every submitted prompt that has them.

    Keyed by the content hash too, so a row is matched with the conversation that rendered exactly its
    prompt ids; when one version was submitted more than once, the latest submit wins.
    """
    loc = layout.locate(output_uri, s3_endpoint_url)
    files = _manifest_files(loc, job)
    columns = [PROMPT_ID, DATASET, CONTENT_HASH, SOURCE_MESSAGES, SOURCE_TOOLS]
    found: dict[tuple[str, str], tuple[str | None, str | None]] = {}
    wanted = set(datasets) if datasets is not None else None
    for path in files:  # sorted by time: later submits overwrite
        dataset = ds.dataset(path, schema=SOURCE_SCHEMA, format="parquet", filesystem=loc.fs)
        table = dataset.to_table(columns=columns)
        for pid, name, digest, messages, tools in zip(*(table[c].to_pylist() for c in columns), strict=True):
            if messages is not None and (wanted is None or name in wanted):
                found[(pid, digest)] = (messages, tools)
    return found


class SourceLookup:
    """:func:`read_sources` for a batch of prompts at a time: the text exports look up each batch's conversations
    (manifest row groups pruned by their ``prompt_id`` statistics, only matching rows decoded), so what is held is
    a batch's sources, never the whole job's. The same answer as :func:`read_sources` for those prompts."""

    def __init__(
        self, output_uri: str, job: str, datasets: Sequence[str] | None = None, s3_endpoint_url: str | None = None
    ) -> None:
        self.loc = layout.locate(output_uri, s3_endpoint_url)
        self.files = _manifest_files(self.loc, job)
        self.wanted = set(datasets) if datasets is not None else None

    def get(self, prompt_ids: Sequence[str]) -> dict[tuple[str, str], tuple[str | None, str | None]]:
        columns = [PROMPT_ID, DATASET, CONTENT_HASH, SOURCE_MESSAGES, SOURCE_TOOLS]
        found: dict[tuple[str, str], tuple[str | None, str | None]] = {}
        if not len(prompt_ids):
            return found
        wanted = pc.field(PROMPT_ID).isin(pa.array(list(dict.fromkeys(prompt_ids)), pa.string()))
        for path in self.files:  # sorted by time: later submits overwrite
            dataset = ds.dataset(path, schema=SOURCE_SCHEMA, format="parquet", filesystem=self.loc.fs)
            table = dataset.to_table(columns=columns, filter=wanted)
            for pid, name, digest, messages, tools in zip(*(table[c].to_pylist() for c in columns), strict=True):
                if messages is not None and (self.wanted is None or name in self.wanted):
                    found[(pid, digest)] = (messages, tools)
        return found


def _manifest_files(loc: layout.Location, job: str) -> list[str]:
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.manifest_dir(job), allow_not_found=True))
    return sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.startswith(MANIFEST_PREFIX)
        and i.base_name.endswith(layout.PARQUET_SUFFIX)
    )


def _json_text(value: Any) -> str | None:
    """Messages/tools as compact JSON (already-JSON text kept as it is); None stays None."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_plain)


def _plain(value: Any) -> Any:
    """numpy scalars/arrays (from Parquet inputs) → Python values; anything else → its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
