"""``producer export JOB``: the committed view as training input, in the shape each trainer reads.

One module per ``--format``, registered in :data:`FORMATS`: ``eagle3`` and ``specforge`` (token ids + loss
mask, built by :mod:`.tokens`), ``hf`` (a Hugging Face dataset), ``messages`` and ``conversations`` (chat
JSONL, built by :mod:`.text`). :mod:`.base` holds what they all share: the committed rows and their filters,
the options, and the files — sharded, each whole or absent, local or S3. A new format is a new module with an
:class:`~storage.exports.base.ExportFormat` subclass, and one line in :data:`FORMATS`.

Output (``--out``): a local path or ``s3://bucket/key`` (resolved by :func:`storage.layout.locate`, with
``THINKFLEET_S3_ENDPOINT_URL``).
"""

from __future__ import annotations

from collections.abc import Sequence

from storage import layout
from storage.exports.base import (
    SPECFORGE_MAX_LENGTH,
    ExportError,
    ExportFormat,
    ExportOptions,
    ExportResult,
    Rows,
)
from storage.exports.conversations import Conversations
from storage.exports.eagle3 import Eagle3
from storage.exports.hf import HF_SCHEMA, HuggingFace, hf_table
from storage.exports.messages import Messages
from storage.exports.provenance import write_export_provenance
from storage.exports.specforge import SpecForge
from storage.exports.text import load_tokenizer, turn_history
from storage.exports.tokens import EAGLE3_SCHEMA, LOSS_MASK, MERGE_MIN_RUN, eagle3_table, merged_table
from thinkfleet.settings import Settings

#: ``--format`` name → the format; the order is the one error messages list them in.
FORMATS: dict[str, type[ExportFormat]] = {
    "eagle3": Eagle3,
    "specforge": SpecForge,
    "hf": HuggingFace,
    "messages": Messages,
    "conversations": Conversations,
}

__all__ = [
    "EAGLE3_SCHEMA",
    "FORMATS",
    "HF_SCHEMA",
    "LOSS_MASK",
    "MERGE_MIN_RUN",
    "SPECFORGE_MAX_LENGTH",
    "ExportError",
    "ExportFormat",
    "ExportOptions",
    "ExportResult",
    "eagle3_table",
    "export_job",
    "hf_table",
    "load_tokenizer",
    "merged_table",
    "turn_history",
]


def export_job(
    settings: Settings,
    job: str,
    fmt: str,
    out: str | None = None,
    *,
    exclude_reasoning: bool = False,
    tokenizer: str | None = None,
    datasets: Sequence[str] | None = None,
    trust_remote_code: bool = False,
    drop_truncated: bool = False,
    drop_flags: Sequence[str] = (),
    min_reasoning_tokens: int = 0,
    shard_rows: int | None = None,
    max_length: int | None = None,
    push_to_hub: str | None = None,
    hub_private: bool = False,
    merge_turns: bool = False,
    image_urls: str = "store",
) -> ExportResult:
    """Write the committed rows of ``job`` in ``fmt`` (a key of :data:`FORMATS`) to ``out`` (local path or
    ``s3://``).

    Raises :class:`ExportError` for anything the caller can fix, before any file is written. A file is
    never left half-written; an I/O error part-way through a sharded export leaves the shards completed
    before it.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    options = ExportOptions(
        datasets=datasets,
        drop_truncated=drop_truncated,
        drop_flags=tuple(drop_flags),
        min_reasoning_tokens=min_reasoning_tokens,
        exclude_reasoning=exclude_reasoning,
        merge_turns=merge_turns,
        max_length=max_length,
        shard_rows=shard_rows,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        push_to_hub=push_to_hub,
        hub_private=hub_private,
        image_urls=image_urls,
    )
    _refuse_unsupported(fmt, options)
    exporter = FORMATS[fmt](options)
    exporter.check()
    out = out or exporter.default_out(job)
    try:
        loc = layout.locate(out, settings.s3_endpoint_url)
    except ValueError as exc:
        raise ExportError(f"--out {out!r}: {exc}") from exc
    result = ExportResult(path=loc.uri(loc.root), format=fmt, rows=0)
    rows = Rows(settings, job, datasets, drop_truncated, min_reasoning_tokens, result.skipped, options.drop_flags)
    exporter.write(result, loc, rows)
    write_export_provenance(settings, job, loc, result, options)  # beside the rows: what made them
    if result.rows == 0:
        result.warnings.append("no rows were exported (nothing committed, or every row filtered out)")
    return result


def _refuse_unsupported(fmt: str, options: ExportOptions) -> None:
    """Refuse an option only some formats take, naming those (read from the registry, so a new one is named too)."""
    if options.merge_turns and not FORMATS[fmt].merges_turns:
        takers = " and ".join(name for name, f in FORMATS.items() if f.merges_turns)
        raise ExportError(f"--merge-turns is for the {takers} formats, not {fmt}")
    if options.push_to_hub is not None and not FORMATS[fmt].pushes:
        takers = " or ".join(f"--format {name}" for name, f in FORMATS.items() if f.pushes)
        raise ExportError(f"--push-to-hub uploads a Hugging Face dataset: use it with {takers}, not {fmt}")
    if options.image_urls != "store" and not FORMATS[fmt].takes_image_urls:
        takers = " and ".join(name for name, f in FORMATS.items() if f.takes_image_urls)
        raise ExportError(
            f"--image-urls is for the {takers} formats, not {fmt} (hf carries the images' bytes; the token formats "
            "carry no images)"
        )
