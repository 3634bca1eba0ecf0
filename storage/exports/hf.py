"""``--format hf``: a Hugging Face dataset (``datasets`` ``save_to_disk``; ``datasets.load_from_disk`` reads it).

The ``eagle3`` columns plus every span and the provenance columns as features (:data:`HF_SCHEMA`); a job run
with ``--no-reasoning-spans`` keeps its null spans. The mask is there twice, equal: ``assistant_masks`` is the
name TRL's ``SFTTrainer`` builds its labels from with its default settings (a column it does not know, such as
``loss_mask``, it ignores, and then trains on the prompt too); ``loss_mask`` is the name the other formats and
SpecForge-style loaders use. ``shard_rows`` becomes ``save_to_disk(num_shards=…)``.
``--push-to-hub REPO`` also uploads it (needs a Hugging Face token), through the one seam :func:`push_dataset`.

A job with image prompts gets four more columns (:func:`with_image_columns`): ``images``, a list of ``datasets.Image``
per row — each image's bytes exactly as the image store holds them (read back and hashed: storage/exports/images.py),
in placeholder order, empty for a text prompt — and ``image_sha256``, ``image_tokens``, ``image_positions`` as stored
(null for a text prompt), so a consumer can expand each placeholder of ``input_ids``. The placeholders are prompt
tokens: ``loss_mask``/``assistant_masks`` are 0 over them as over the rest of the prompt. A text-only job's dataset
has none of these columns (an ``images`` column makes TRL take a dataset for a vision one).
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from storage import layout
from storage.exports.base import (
    COLUMNS,
    TRL_MAX_LENGTH,
    ExportError,
    ExportFormat,
    ExportResult,
    LengthCheck,
    Rows,
    upload,
)
from storage.exports.images import ImageBytes
from storage.exports.tokens import eagle3_table
from storage.schema import (
    ANSWER_END,
    ANSWER_START,
    CHAT_TEMPLATE_HASH,
    COMPLETION_TOKENS,
    CONTENT_HASH,
    CREATED_AT,
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    IMAGE_PATHS,
    IMAGE_POSITIONS,
    IMAGE_SHA256,
    IMAGE_TOKENS,
    MODEL,
    PROMPT_ID,
    PROMPT_TOKENS,
    REASONING_END,
    REASONING_START,
    REVISION,
    ROW_INDEX,
    SAMPLE_INDEX,
    SAMPLING_PARAMS,
    STOP_TOKEN,
    TOKENIZER_FINGERPRINT,
    TOOL_CALL_SPANS,
    WEIGHT_VERSION,
)

#: How to add the ``hub`` extra — in a clone (the README's install) the extra is named by the checkout, not by
#: the distribution name, which is not on PyPI.
HF_EXTRA = "in the checkout, `.venv/bin/pip install -e '.[hub]'`"
#: The mask column TRL's SFTTrainer reads with its defaults (1: the token carries loss).
TRL_MASK = "assistant_masks"
#: The ``hf`` dataset: the eagle3 columns (the mask also as :data:`TRL_MASK`), then the spans (offsets into the
#: OUTPUT, i.e. into ``input_ids[prompt_len:]``) and provenance. Plain nullable Arrow types, so ``datasets`` maps
#: them to features without a cast.
HF_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field(DATASET, pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field(TRL_MASK, pa.list_(pa.int8())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("prompt_len", pa.int32()),
        pa.field(REASONING_START, pa.int32()),
        pa.field(REASONING_END, pa.int32()),
        pa.field(HAS_THINK_END, pa.bool_()),
        pa.field(ANSWER_START, pa.int32()),
        pa.field(ANSWER_END, pa.int32()),
        pa.field(TOOL_CALL_SPANS, pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32())]))),
        pa.field(STOP_TOKEN, pa.int32()),
        pa.field(FINISH_REASON, pa.string()),
        pa.field(PROMPT_TOKENS, pa.int32()),
        pa.field(COMPLETION_TOKENS, pa.int32()),
        pa.field(ROW_INDEX, pa.int64()),
        pa.field(SAMPLE_INDEX, pa.int32()),
        pa.field(REVISION, pa.int32()),
        pa.field(MODEL, pa.string()),
        pa.field(WEIGHT_VERSION, pa.string()),
        pa.field(SAMPLING_PARAMS, pa.string()),
        pa.field(TOKENIZER_FINGERPRINT, pa.string()),
        pa.field(CHAT_TEMPLATE_HASH, pa.string()),
        pa.field(CONTENT_HASH, pa.string()),
        pa.field(CREATED_AT, pa.timestamp("us", tz="UTC")),
    ]
)
#: The columns built from the token records; the rest are the stored columns as they are.
_TOKEN_COLUMNS = 6
_HF_PROVENANCE = HF_SCHEMA.names[_TOKEN_COLUMNS:]
_HF_COLUMNS = list(dict.fromkeys([*COLUMNS, *_HF_PROVENANCE]))
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def hf_table(table: pa.Table, exclude_reasoning: bool = False) -> pa.Table:
    """Committed rows (with :data:`_HF_COLUMNS`) → the ``hf`` dataset's columns (:data:`HF_SCHEMA`)."""
    tokens = eagle3_table(table, exclude_reasoning)
    mask = tokens["loss_mask"]
    columns = [tokens["id"], tokens[DATASET], tokens["input_ids"], mask, mask, tokens["prompt_len"]]
    columns += [table[name] for name in _HF_PROVENANCE]
    return pa.Table.from_arrays([c.cast(f.type) for c, f in zip(columns, HF_SCHEMA, strict=True)], schema=HF_SCHEMA)


#: An image prompt's images (``datasets.Image`` each) and their references, after the :data:`HF_SCHEMA` columns.
IMAGES = "images"
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets.Image's storage
IMAGE_FIELDS = [
    pa.field(IMAGES, pa.list_(IMAGE_STRUCT)),
    pa.field(IMAGE_SHA256, pa.list_(pa.string())),
    pa.field(IMAGE_TOKENS, pa.list_(pa.int32())),
    pa.field(IMAGE_POSITIONS, pa.list_(pa.int32())),
]
_IMAGE_COLUMNS = [IMAGE_SHA256, IMAGE_PATHS, IMAGE_TOKENS, IMAGE_POSITIONS]
#: Rows whose images are read and written at once (an image may be up to THINKFLEET_MAX_IMAGE_BYTES, 20 MiB).
IMAGE_SLICE_ROWS = 32


def image_schema(hf_datasets: Any) -> pa.Schema:
    """:data:`HF_SCHEMA` + :data:`IMAGE_FIELDS`, with the ``datasets`` features that make ``images`` a list of
    ``Image`` (the schema's metadata: ``Dataset.from_file`` and ``load_from_disk`` read them from there)."""
    schema = pa.schema([*HF_SCHEMA, *IMAGE_FIELDS])
    features = hf_datasets.Features.from_arrow_schema(schema)
    features[IMAGES] = hf_datasets.List(hf_datasets.Image())
    return schema.with_metadata(features.arrow_schema.metadata)


def with_image_columns(records: pa.Table, table: pa.Table, schema: pa.Schema, images: ImageBytes) -> pa.Table:
    """``records`` (:func:`hf_table` of ``table``) with the image columns of ``schema``: each image read back from
    the store and checked against its sha256 (the struct's ``path`` is the store's file name, for the reader's eyes:
    the bytes are there)."""
    column: list[list[dict[str, Any]]] = []
    rows = zip(table[PROMPT_ID].to_pylist(), table[IMAGE_PATHS].to_pylist(), table[IMAGE_SHA256].to_pylist(),
               strict=True)  # fmt: skip
    for pid, uris, digests in rows:
        pairs = zip(uris or (), digests or (), strict=True)
        column.append([{"bytes": images.get(uri, sha, pid), "path": posixpath.basename(uri)} for uri, sha in pairs])
    arrays = [pa.array(column, schema.field(IMAGES).type)]
    arrays += [table[name].cast(schema.field(name).type) for name in (IMAGE_SHA256, IMAGE_TOKENS, IMAGE_POSITIONS)]
    return pa.Table.from_arrays([*records.columns, *arrays], schema=schema)


def _has_image_rows(rows: Rows) -> bool:
    """Does any committed row (of the datasets exported) hold images? One column read."""
    return any(t[IMAGE_SHA256].null_count < t.num_rows for t in rows.tables([IMAGE_SHA256], filtered=False))


#: The Hub upload, a seam for tests (no network here): ``push_dataset(dataset, repo, token=…, …)``.
def push_dataset(dataset: Any, repo: str, *, token: str | None, private: bool, num_shards: int | None) -> None:
    dataset.push_to_hub(repo, token=token, private=private, num_shards=num_shards)


class HuggingFace(ExportFormat):
    name = "hf"
    suffix = ""  # a directory
    pushes = True
    length_limit = TRL_MAX_LENGTH
    length_advice = (
        f"TRL's SFTTrainer cuts rows at SFTConfig.max_length (default {TRL_MAX_LENGTH}) without a warning, and drops "
        "a row whose prompt alone fills it: set max_length={longest} (or None), or these rows lose their tail"
    )

    hub_token: str | None = None

    def check(self) -> None:
        """Validate ``--push-to-hub`` before anything is read, and find the token to push with."""
        repo = self.options.push_to_hub
        if repo is None:
            return
        if not _REPO_ID.match(repo) or ".." in repo or repo.endswith((".", "-")):
            raise ExportError(f"--push-to-hub {repo!r} is not a Hub repo id: use NAME or OWNER/NAME")
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        if not token:
            try:
                from huggingface_hub import get_token

                token = get_token()
            except ImportError:
                token = None
        if not token:
            raise ExportError(
                "--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`"
            )
        self.hub_token = token

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        try:
            import datasets as hf_datasets
        except ImportError as exc:
            raise ExportError(f"--format hf needs the Hugging Face `datasets` package: {HF_EXTRA}") from exc

        quiet = hf_datasets.is_progress_bar_enabled()
        if quiet:
            hf_datasets.disable_progress_bars()  # stdout/stderr stay for our own report (--json)
        try:
            self._save(hf_datasets, result, loc, rows)
        finally:
            if quiet:
                hf_datasets.enable_progress_bars()

    def _save(self, hf_datasets: Any, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        opts = self.options
        lengths = LengthCheck(self.max_length)
        schema, columns, images = HF_SCHEMA, _HF_COLUMNS, None
        if _has_image_rows(rows):  # (a text-only job's dataset keeps the plain schema)
            schema, columns = image_schema(hf_datasets), [*_HF_COLUMNS, *_IMAGE_COLUMNS]
            images = ImageBytes(rows.settings.s3_endpoint_url)
        with tempfile.TemporaryDirectory(prefix="thinkfleet-hf-") as tmp:
            arrow_path = os.path.join(tmp, "rows.arrow")
            with pa.OSFile(arrow_path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for batch in rows.tables(columns):
                    # The batches are sized by their stored columns, which hold no image bytes: with images, a few
                    # rows at a time, so memory holds IMAGE_SLICE_ROWS rows' images whatever their sizes.
                    step = IMAGE_SLICE_ROWS if images is not None else max(1, batch.num_rows)
                    for start in range(0, batch.num_rows, step):
                        table = batch.slice(start, step)
                        records = hf_table(table, opts.exclude_reasoning)
                        if images is not None:
                            records = with_image_columns(records, table, schema, images)
                        writer.write_table(records)
                        result.rows += records.num_rows
                        lengths.add_records(records)
            dataset = hf_datasets.Dataset.from_file(arrow_path)  # memory-mapped: never all in memory
            # One shard at least: datasets saves an empty dataset with none, and then cannot load it.
            num_shards = max(1, math.ceil(result.rows / opts.shard_rows)) if opts.shard_rows else None
            if not result.rows:
                num_shards = 1
            if loc.is_local:
                result.files = _save_local_dataset(dataset, loc.root, num_shards)
            else:
                saved = os.path.join(tmp, "dataset")
                dataset.save_to_disk(saved, num_shards=num_shards)
                result.files = _upload_dataset(loc, saved)
            if opts.push_to_hub:
                push_dataset(
                    dataset, opts.push_to_hub, token=self.hub_token, private=opts.hub_private, num_shards=num_shards
                )
                result.pushed_to = opts.push_to_hub
            del dataset  # release the memory map before the temporary directory goes
        lengths.report(result, self.length_advice)


def _save_local_dataset(dataset: Any, path: str, num_shards: int | None) -> list[str]:
    """``save_to_disk`` into a hidden sibling, then swap it in; an old export there is replaced whole."""
    if os.path.exists(path) and not _is_saved_dataset(path):
        raise ExportError(
            f"--out {path} exists and is not a saved dataset (no state.json): choose another --out or remove it"
        )
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    old = f"{tmp}-old"
    try:
        dataset.save_to_disk(tmp, num_shards=num_shards)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (not os.listdir(path) or os.path.exists(os.path.join(path, "state.json")))


def _upload_dataset(loc: layout.Location, local_dir: str) -> list[str]:
    """Upload a saved dataset under ``loc.root``: data files first, ``state.json`` last; stale shards removed."""
    names = sorted(os.listdir(local_dir), key=lambda n: (n in ("dataset_info.json", "state.json"), n))
    written = []
    for name in names:
        path = posixpath.join(loc.root, name)
        upload(loc, os.path.join(local_dir, name), path)
        written.append(path)
    stale = re.compile(r"^data-\d{5}-of-\d{5}\.arrow$")
    for info in loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True)):
        if info.type == pafs.FileType.File and stale.match(info.base_name) and info.path not in written:
            loc.fs.delete_file(info.path)
    return [loc.uri(p) for p in written]
