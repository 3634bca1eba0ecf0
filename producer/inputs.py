"""Datasets → conversations: readers, conversation-column detection and row validation.

Inputs (local files and directories, ``s3://``, save_to_disk directories, hub ids) are read by
:mod:`producer.sources`. A row becomes a
:class:`Prompt`: OpenAI-style messages cut after the last user (or tool) turn — the trailing assistant
turns are what we regenerate — plus optional tools, and for an image prompt its images (content parts, an
``images`` column, ``<image>`` markers: :mod:`producer.image_parts`; each read, checked and stored by
:mod:`producer.images`).

Every problem a user can cause is a :class:`Problem` naming ``file:line`` (or ``file row N``) and what
to do; the caller decides whether problems abort the submit or are skipped and recorded.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from producer.image_parts import IMAGE_PART_TYPES, RowImages, column_images
from producer.images import DatasetBase, ImageError, ImageResolver
from producer.sources import (
    S3_SCHEMES,
    SKIP_HINT,
    SUFFIXES,
    InputError,
    Problem,
    Source,
    count_rows,
    is_hf_dataset_dir,
    locate_input,
    records,
)
from thinkfleet.vision import ImageRef

__all__ = [
    "S3_SCHEMES",
    "SUFFIXES",
    "Columns",
    "Dataset",
    "ImageError",
    "InputError",
    "Problem",
    "Prompt",
    "RowError",
    "Source",
    "count_rows",
    "dataset_name",
    "is_hf_dataset_dir",
    "iter_prompts",
    "open_dataset",
    "read_dataset",
]

#: ShareGPT ``from`` values → OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
}
ROLES = {"system", "user", "assistant", "tool"}
#: Message keys kept for the chat template (others are dropped so rendering is deterministic).
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RowError(ValueError):
    """One row is unusable; the message says why (the reader adds where)."""


@dataclass(frozen=True)
class Columns:
    """Which columns hold the conversation; ``None`` = detect from the first row."""

    messages: str | None = None
    conversations: str | None = None
    prompt: str | None = None
    system: str | None = None
    tools: str | None = None
    id: str | None = "id"  # "" disables ids: prompt ids are then dataset/row_index
    #: A column of images (``<image>`` markers or bare ``{"type": "image"}`` parts take them in order); None =
    #: ``images`` or ``image`` when the rows have one, "" = none (producer/images.py).
    images: str | None = None


@dataclass(frozen=True)
class Prompt:
    """One conversation to render, with where it came from."""

    prompt_id: str  # dataset/<id column> or dataset/<row index>; the sample suffix is added later
    row_index: int
    location: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    #: An image prompt's images in the order of their parts (stored, measured: producer/images.py); () for text.
    images: tuple[ImageRef, ...] = ()


@dataclass
class Dataset:
    name: str
    source: Source
    prompts: list[Prompt] = field(default_factory=list)
    rows: int = 0
    #: What reads this dataset's images (set by ``producer submit``); None: a row with images is a problem.
    images: ImageResolver | None = None


@dataclass
class _Layout:
    kind: str  # messages | conversations | prompt
    column: str
    system: str | None
    tools: str | None
    id: str | None
    images: str | None = None  # None: ``images`` or ``image`` in each row that has one; "": none


# -- conversations ---------------------------------------------------------------------------------------
def _detect(record: dict[str, Any], columns: Columns, where: str) -> _Layout:
    named = [
        (k, c)
        for k, c in (
            ("messages", columns.messages),
            ("conversations", columns.conversations),
            ("prompt", columns.prompt),
        )
        if c
    ]
    if len(named) > 1:
        raise InputError("name one of --messages-column, --conversations-column, --prompt-column, not several")
    if named:
        kind, column = named[0]
        if column not in record:
            raise InputError(f"{where}: no column {column!r} (columns: {sorted(record)}); check --{kind}-column")
    else:
        for kind in ("messages", "conversations", "prompt"):
            if kind in record:
                column = kind
                break
        else:
            raise InputError(
                f"{where}: no conversation column among {sorted(record)}; expected 'messages' (OpenAI), "
                "'conversations' (ShareGPT) or 'prompt', or name one with --messages-column, "
                "--conversations-column or --prompt-column"
            )
    for flag, col in (
        ("--system-column", columns.system),
        ("--tools-column", columns.tools),
        ("images_column", columns.images),
    ):
        if col and col not in record:
            raise InputError(f"{where}: no column {col!r} (columns: {sorted(record)}); check {flag}")
    system = columns.system or ("system" if "system" in record and kind != "messages" else None)
    tools = columns.tools or ("tools" if "tools" in record else None)
    id_col = columns.id if columns.id and columns.id in record else None
    if columns.id and columns.id != "id" and id_col is None:
        raise InputError(f"{where}: no column {columns.id!r} (columns: {sorted(record)}); check --id-column")
    return _Layout(kind, column, system, tools, id_col, columns.images)


def _maybe_json(value: Any, what: str) -> Any:
    """CSV (and some JSONL) store nested columns as JSON text."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError as e:
            raise RowError(f"{what} is text that is not valid JSON ({e})") from e
    return value


def _content(value: Any, i: int, role: str, images: RowImages) -> str | list[dict[str, Any]] | None:
    """A message's content: a string, or text and image parts (an image prompt: producer/images.py). Text parts
    alone are joined into one string, as the chat template renders them."""
    if value is None:
        return None
    if isinstance(value, str):
        return images.split(value)
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(value):
            kind = p.get("type", "text")
            if kind == "text" and isinstance(p.get("text"), str):
                split = images.split(p["text"])
                parts.extend([{"type": "text", "text": split}] if isinstance(split, str) else split)
            elif kind in IMAGE_PART_TYPES:
                parts.append(images.part(p))
            else:
                raise RowError(
                    f"message {i} ({role}) part {j} is of type {kind!r}; content parts are text, image_url or image"
                )
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)  # OpenAI text parts
        return parts
    raise RowError(
        f"message {i} ({role}) has non-string content ({type(value).__name__}); content must be a string "
        "or a list of text and image parts"
    )


def _clean(message: Any, i: int, images: RowImages) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError(f"message {i} is a {type(message).__name__}, not an object with role and content")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise RowError(f"message {i} has role {role!r}; expected one of {sorted(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), i, role, images)}
    if out["content"] is None and not (role == "assistant" and message.get("tool_calls")):
        raise RowError(f"message {i} ({role}) has no content")
    if isinstance(message.get("name"), str) and message["name"]:
        out["name"] = message["name"]
    if role == "assistant":
        if message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], i)
        if isinstance(message.get("reasoning_content"), str):
            out["reasoning_content"] = message["reasoning_content"]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id") or message.get("id") or ""
    return out


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    value = _maybe_json(value, f"message {i} tool_calls")
    if not isinstance(value, list):
        raise RowError(f"message {i} tool_calls must be a list")
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(f"message {i} has a tool call without function.name")
        if not isinstance(fn.get("arguments"), str | dict):
            raise RowError(f"message {i} tool call {fn['name']!r} has arguments that are neither text nor an object")
    return value


def _messages(record: dict[str, Any], layout: _Layout, images: RowImages) -> list[dict[str, Any]]:
    """The conversation to render: cleaned, cut after its last user (or tool) turn, its kept images resolved."""
    value = record.get(layout.column)
    if value is None:
        raise RowError(f"column {layout.column!r} is missing or null")
    if layout.kind == "prompt":
        if not isinstance(value, str):
            raise RowError(f"column {layout.column!r} is a {type(value).__name__}; a prompt must be a string")
        raw: list[Any] = [{"role": "user", "content": value}]
    else:
        raw = _maybe_json(value, f"column {layout.column!r}")
        if not isinstance(raw, list):
            raise RowError(f"column {layout.column!r} is a {type(raw).__name__}; expected a list of messages")
        if layout.kind == "conversations":
            raw = [_sharegpt(m, i) for i, m in enumerate(raw)]
    if layout.system:
        system = record.get(layout.system)
        if system is not None and not isinstance(system, str):
            raise RowError(f"column {layout.system!r} is a {type(system).__name__}; a system prompt must be a string")
        if system and not (raw and isinstance(raw[0], dict) and raw[0].get("role") == "system"):
            raw = [{"role": "system", "content": system}, *raw]
    if not raw:
        raise RowError("empty conversation")
    messages = [_clean(m, i, images) for i, m in enumerate(raw)]
    last = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=None)
    if last is None or not any(m["role"] == "user" for m in messages[: last + 1]):
        raise RowError("conversation has no user turn; nothing to answer")
    unplaced = images.leftover()
    if unplaced:  # an images column and no marker: the images open the first user turn
        first = next(m for m in messages if m["role"] == "user")
        text = first["content"]
        first["content"] = unplaced + ([{"type": "text", "text": text}] if isinstance(text, str) and text else [])
    if messages[last]["role"] == "user" and not _has_content(messages[last]["content"]):
        raise RowError(f"the last user turn (message {last}) is empty")
    kept = messages[: last + 1]  # trailing assistant turns are what we regenerate
    images.resolve(kept)
    return kept


def _image_column(record: dict[str, Any], name: str | None) -> list[Any] | None:
    """A row's images column as a list; None when it has none (JSONL rows may differ in their keys)."""
    if name is None:  # "" turns image columns off (a text dataset with a column named "image")
        name = next((c for c in ("images", "image") if c in record), None)
    return column_images(record.get(name)) if name else None


def _has_content(content: str | list[dict[str, Any]] | None) -> bool:
    if isinstance(content, list):
        return any(p["type"] != "text" or p["text"].strip() for p in content)
    return bool((content or "").strip())


def _sharegpt(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or "from" not in message:
        raise RowError(f"conversation turn {i} has no 'from' (ShareGPT turns are {{from, value}})")
    role = SHAREGPT_ROLES.get(str(message["from"]).lower())
    if role is None:
        raise RowError(f"conversation turn {i} is from {message['from']!r}; expected one of {sorted(SHAREGPT_ROLES)}")
    return {"role": role, "content": message.get("value")}


def _tools(record: dict[str, Any], layout: _Layout) -> list[dict[str, Any]] | None:
    if not layout.tools:
        return None
    value = _maybe_json(record.get(layout.tools), f"column {layout.tools!r}")
    if value in (None, "", []):
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError(f"column {layout.tools!r} must be a list of tool objects (OpenAI function specs)")
    return value


# -- datasets --------------------------------------------------------------------------------------------
def open_dataset(
    path: str | Path, name: str | None = None, s3_endpoint_url: str | None = None, split: str | None = None
) -> Dataset:
    """A dataset to read: resolves the input (:func:`locate_input`) and checks the name (file stem,
    directory name, or the last part of a hub id) up front."""
    source = locate_input(str(path), s3_endpoint_url, split)
    return Dataset(check_dataset_name(name or dataset_name(source.given), source.given), source)


def dataset_name(path: str | Path) -> str:
    """The default dataset name: a file's stem, a directory's (or hub id's) last part."""
    text = str(path).rstrip("/")
    if not text.startswith(S3_SCHEMES) and Path(text).is_dir():
        return Path(text).name
    last = text.rsplit("/", 1)[-1]
    stem, suffix = posixpath.splitext(last)
    return stem if suffix in SUFFIXES else last


def iter_prompts(
    dataset: Dataset, columns: Columns = Columns(), split: str | None = None, problems: list[Problem] | None = None
) -> Iterator[Prompt]:
    """The dataset's prompts, read lazily (the submit renders while it reads); counts ``dataset.rows``.

    Row problems are appended to ``problems``; a file-level problem raises :class:`InputError`.
    """
    collect = problems if problems is not None else []
    layout: _Layout | None = None
    seen = SeenIds()
    base = DatasetBase.of(dataset.source) if dataset.images is not None else None
    for row_index, (loc, record) in enumerate(records(dataset.source, collect, split)):
        dataset.rows += 1
        if record is None:
            continue  # the reader recorded why
        if layout is None:
            layout = _detect(record, columns, loc)
        try:
            column = _image_column(record, layout.images)
            images = RowImages(dataset.images, base, column)
            messages = _messages(record, layout, images)
            tools = _tools(record, layout)
            key = _row_id(record, layout, row_index)
        except (RowError, ImageError) as e:
            collect.append(Problem(loc, f"{e}; {SKIP_HINT}"))
            continue
        prompt_id = f"{dataset.name}/{key}"
        first = seen.seen_at(prompt_id, loc)
        if first is not None:
            collect.append(Problem(loc, f"duplicate id {key!r} (first at {first}); ids must be unique"))
            continue
        yield Prompt(prompt_id, row_index, loc, messages, tools, tuple(images.refs))
    if dataset.rows == 0:
        raise InputError(f"{dataset.source}: no rows")


#: Ids :class:`SeenIds` holds in a dict before they join its sorted arrays.
_SEEN_CHUNK = 1 << 16
#: A location's trailing row number (``file.jsonl:12``, ``file.parquet row 7``), kept apart from its file part.
_TRAILING_NUMBER = re.compile(r"(?:0|[1-9][0-9]{0,17})$")


class SeenIds:
    """The prompt ids a dataset's read has passed, and where each was first: ~32 bytes an id (a 128-bit hash, the
    location as an index of its file part and a row number) in sorted arrays, instead of a dict of strings (~190
    bytes an id: a million-row submit held 190 MB for it). Runs of about equal size are merged (as an LSM tree
    does), so a look-up searches a few of them."""

    def __init__(self) -> None:
        self._pending: dict[bytes, tuple[int, int]] = {}
        self._runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (hi, lo, place) sorted by (hi, lo)
        self._prefix_index: dict[str, int] = {}
        self._prefixes: list[str] = []

    def seen_at(self, prompt_id: str, loc: str) -> str | None:
        """Where ``prompt_id`` was read before; None when it was not (it is then recorded as read at ``loc``)."""
        key = hashlib.blake2b(prompt_id.encode(), digest_size=16).digest()
        place = self._pending.get(key)
        if place is None:
            place = self._find(int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little"))
        if place is not None:
            prefix, number = place
            return self._prefixes[prefix] + (str(number) if number >= 0 else "")
        self._pending[key] = self._place(loc)
        if len(self._pending) >= _SEEN_CHUNK:
            self._flush()
        return None

    def _find(self, hi: int, lo: int) -> tuple[int, int] | None:
        for his, los, places in self._runs:
            i = int(np.searchsorted(his, np.uint64(hi)))  # (a Python int past int64 would make it compare objects)
            while i < len(his) and int(his[i]) == hi:
                if int(los[i]) == lo:
                    return int(places[i, 0]), int(places[i, 1])
                i += 1
        return None

    def _place(self, loc: str) -> tuple[int, int]:
        match = _TRAILING_NUMBER.search(loc)
        prefix, number = (loc[: match.start()], int(match.group())) if match else (loc, -1)
        index = self._prefix_index.setdefault(prefix, len(self._prefixes))
        if index == len(self._prefixes):
            self._prefixes.append(prefix)
        return index, number

    def _flush(self) -> None:
        halves = np.frombuffer(b"".join(self._pending), dtype="<u8").reshape(-1, 2)
        places = np.array(list(self._pending.values()), dtype=np.int64).reshape(-1, 2)
        self._pending = {}
        self._runs.append((halves[:, 0], halves[:, 1], places))
        while len(self._runs) > 1 and len(self._runs[-2][0]) <= 2 * len(self._runs[-1][0]):
            newer, older = self._runs.pop(), self._runs.pop()
            self._runs.append(tuple(np.concatenate([o, n]) for o, n in zip(older, newer, strict=True)))  # type: ignore[arg-type]
        his, los, places = self._runs[-1]
        order = np.lexsort((los, his))
        self._runs[-1] = (np.ascontiguousarray(his[order]), np.ascontiguousarray(los[order]), places[order])


def read_dataset(
    path: str | Path,
    name: str | None = None,
    columns: Columns = Columns(),
    split: str | None = None,
    problems: list[Problem] | None = None,
) -> Dataset:
    """Read one input into ``Dataset.prompts``; row problems go to ``problems`` (raises if not given)."""
    dataset = open_dataset(path, name, split=split)
    collect = problems if problems is not None else []
    dataset.prompts = list(iter_prompts(dataset, columns, split, collect))
    if problems is None and collect:
        raise InputError("\n".join(str(p) for p in collect))
    return dataset


def check_dataset_name(name: str, path: str | Path) -> str:
    """Dataset names become Redis keys and ``dataset=NAME`` storage partitions: keep them plain."""
    if not _NAME.fullmatch(name):
        raise InputError(
            f"{path}: dataset name {name!r} is not plain (letters, digits, '.', '_', '-'); pass --dataset-name"
        )
    return name


def _row_id(record: dict[str, Any], layout: _Layout, row_index: int) -> str:
    if not layout.id:
        return str(row_index)
    value = record.get(layout.id)
    if value is None or value == "" or not isinstance(value, str | int):
        raise RowError(
            f"id column {layout.id!r} is empty or not a string/integer (pass --id-column '' to use row numbers)"
        )
    return str(value)
