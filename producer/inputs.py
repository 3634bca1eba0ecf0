"""Datasets → conversations: readers, conversation-column detection and row validation.

Formats: JSONL, JSON (a list of objects), Parquet, CSV, a directory of such files (one dataset, the
files read in name order) and a Hugging Face ``save_to_disk`` directory. A row becomes a
:class:`Prompt`: OpenAI-style messages cut after the last user (or tool) turn — the trailing assistant
turns are what we regenerate — plus optional tools.

Every problem a user can cause is a :class:`Problem` naming ``file:line`` (or ``file row N``) and what
to do; the caller decides whether problems abort the submit or are skipped and recorded.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: File suffixes read as datasets.
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
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
SKIP_HINT = "fix the row, or pass --skip-invalid to skip and record it"


class InputError(Exception):
    """A user error that stops the submit before anything is enqueued."""


class RowError(ValueError):
    """One row is unusable; the message says why (the reader adds where)."""


@dataclass(frozen=True)
class Problem:
    location: str  # "data/train.jsonl:17" or "data/x.parquet row 16"
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass(frozen=True)
class Columns:
    """Which columns hold the conversation; ``None`` = detect from the first row."""

    messages: str | None = None
    conversations: str | None = None
    prompt: str | None = None
    system: str | None = None
    tools: str | None = None
    id: str | None = "id"  # "" disables ids: prompt ids are then dataset/row_index


@dataclass(frozen=True)
class Prompt:
    """One conversation to render, with where it came from."""

    prompt_id: str  # dataset/<id column> or dataset/<row index>; the sample suffix is added later
    row_index: int
    location: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass
class Dataset:
    name: str
    source: Path
    prompts: list[Prompt] = field(default_factory=list)
    rows: int = 0


@dataclass
class _Layout:
    kind: str  # messages | conversations | prompt
    column: str
    system: str | None
    tools: str | None
    id: str | None


# -- readers: (location, record) per row ----------------------------------------------------------------
def _read_jsonl(path: Path, problems: list[Problem]) -> Iterator[tuple[str, dict[str, Any] | None]]:
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            loc = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except ValueError as e:
                problems.append(Problem(loc, f"not valid JSON ({e}); {SKIP_HINT}"))
                yield loc, None
                continue
            if not isinstance(record, dict):
                problems.append(Problem(loc, f"a JSON {type(record).__name__}, not an object; {SKIP_HINT}"))
                yield loc, None
                continue
            yield loc, record


def _read_json(path: Path, problems: list[Problem]) -> Iterator[tuple[str, dict[str, Any] | None]]:
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:
        # A .json file may really be JSON Lines.
        if path.read_bytes().lstrip()[:1] == b"{":
            yield from _read_jsonl(path, problems)
            return
        raise InputError(f"{path}: not valid JSON ({e}); a .json input must be a list of objects") from e
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise InputError(f"{path}: a JSON object, not a list of rows; save the rows as a JSON list or JSONL")
        data = lists[0]
    if not isinstance(data, list):
        raise InputError(f"{path}: top level is a {type(data).__name__}; a .json input must be a list of objects")
    for i, record in enumerate(data):
        loc = f"{path} item {i}"
        if not isinstance(record, dict):
            problems.append(Problem(loc, f"a JSON {type(record).__name__}, not an object; {SKIP_HINT}"))
            yield loc, None
        else:
            yield loc, record


def _read_parquet(path: Path, problems: list[Problem]) -> Iterator[tuple[str, dict[str, Any] | None]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from e
    i = 0
    for batch in pf.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"{path} row {i}", record
            i += 1


def _read_csv(path: Path, problems: list[Problem]) -> Iterator[tuple[str, dict[str, Any] | None]]:
    csv.field_size_limit(1 << 30)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            for record in reader:
                yield f"{path}:{reader.line_num}", dict(record)
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{reader.line_num + 1}: not UTF-8 text ({e}); re-save the file as UTF-8") from e


def _read_hf(path: Path, split: str | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise InputError(f"{path}: not a readable Hugging Face save_to_disk directory ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None and len(names) == 1:
            split = names[0]
        if split not in ds:
            raise InputError(f"{path}: a DatasetDict with splits {names}; choose one with --split")
        ds = ds[split]
    for i, record in enumerate(ds):
        yield f"{path} row {i}", record


def count_rows(path: Path) -> int | None:
    """Rows in an input, cheaply, for a progress bar's total (JSONL lines, Parquet metadata); None if unknown."""
    try:
        if path.is_dir():
            if is_hf_dataset_dir(path):
                return None
            counts = [count_rows(p) for p in sorted(path.iterdir()) if p.is_file() and p.suffix in SUFFIXES]
            return None if None in counts else sum(c or 0 for c in counts)
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except OSError:
        return None
    return None


def is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def _records(path: Path, problems: list[Problem], split: str | None) -> Iterator[tuple[str, dict | None]]:
    if path.is_dir():
        if is_hf_dataset_dir(path):
            yield from _read_hf(path, split)
            return
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise InputError(f"{path}: a directory with no {', '.join(SUFFIXES)} files and no save_to_disk dataset")
        for f in files:
            yield from _records(f, problems, split)
        return
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
    reader = readers.get(path.suffix)
    if reader is None:
        raise InputError(f"{path}: unknown format; use {', '.join(SUFFIXES)}, a directory, or a save_to_disk dataset")
    yield from reader(path, problems)


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
    for flag, col in (("--system-column", columns.system), ("--tools-column", columns.tools)):
        if col and col not in record:
            raise InputError(f"{where}: no column {col!r} (columns: {sorted(record)}); check {flag}")
    system = columns.system or ("system" if "system" in record and kind != "messages" else None)
    tools = columns.tools or ("tools" if "tools" in record else None)
    id_col = columns.id if columns.id and columns.id in record else None
    if columns.id and columns.id != "id" and id_col is None:
        raise InputError(f"{where}: no column {columns.id!r} (columns: {sorted(record)}); check --id-column")
    return _Layout(kind, column, system, tools, id_col)


def _maybe_json(value: Any, what: str) -> Any:
    """CSV (and some JSONL) store nested columns as JSON text."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError as e:
            raise RowError(f"{what} is text that is not valid JSON ({e})") from e
    return value


def _content(value: Any, i: int, role: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)  # OpenAI text parts
    raise RowError(
        f"message {i} ({role}) has non-string content ({type(value).__name__}); content must be a string "
        "(or a list of text parts)"
    )


def _clean(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError(f"message {i} is a {type(message).__name__}, not an object with role and content")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise RowError(f"message {i} has role {role!r}; expected one of {sorted(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), i, role)}
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


def _messages(record: dict[str, Any], layout: _Layout) -> list[dict[str, Any]]:
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
    messages = [_clean(m, i) for i, m in enumerate(raw)]
    last = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=None)
    if last is None or not any(m["role"] == "user" for m in messages[: last + 1]):
        raise RowError("conversation has no user turn; nothing to answer")
    if messages[last]["role"] == "user" and not (messages[last]["content"] or "").strip():
        raise RowError(f"the last user turn (message {last}) is empty")
    return messages[: last + 1]  # trailing assistant turns are what we regenerate


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
def open_dataset(path: str | Path, name: str | None = None) -> Dataset:
    """A dataset to read: checks the path and the name (file stem, or directory name) up front."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    return Dataset(check_dataset_name(name or dataset_name(path), path), path)


def dataset_name(path: Path) -> str:
    return path.name if path.is_dir() else path.stem


def iter_prompts(
    dataset: Dataset, columns: Columns = Columns(), split: str | None = None, problems: list[Problem] | None = None
) -> Iterator[Prompt]:
    """The dataset's prompts, read lazily (the submit renders while it reads); counts ``dataset.rows``.

    Row problems are appended to ``problems``; a file-level problem raises :class:`InputError`.
    """
    collect = problems if problems is not None else []
    layout: _Layout | None = None
    seen: dict[str, str] = {}
    for row_index, (loc, record) in enumerate(_records(dataset.source, collect, split)):
        dataset.rows += 1
        if record is None:
            continue  # the reader recorded why
        if layout is None:
            layout = _detect(record, columns, loc)
        try:
            messages = _messages(record, layout)
            tools = _tools(record, layout)
            key = _row_id(record, layout, row_index)
        except RowError as e:
            collect.append(Problem(loc, f"{e}; {SKIP_HINT}"))
            continue
        prompt_id = f"{dataset.name}/{key}"
        if prompt_id in seen:
            collect.append(Problem(loc, f"duplicate id {key!r} (first at {seen[prompt_id]}); ids must be unique"))
            continue
        seen[prompt_id] = loc
        yield Prompt(prompt_id, row_index, loc, messages, tools)
    if dataset.rows == 0:
        raise InputError(f"{dataset.source}: no rows")


def read_dataset(
    path: str | Path,
    name: str | None = None,
    columns: Columns = Columns(),
    split: str | None = None,
    problems: list[Problem] | None = None,
) -> Dataset:
    """Read one input into ``Dataset.prompts``; row problems go to ``problems`` (raises if not given)."""
    dataset = open_dataset(path, name)
    collect = problems if problems is not None else []
    dataset.prompts = list(iter_prompts(dataset, columns, split, collect))
    if problems is None and collect:
        raise InputError("\n".join(str(p) for p in collect))
    return dataset


def check_dataset_name(name: str, path: Path) -> str:
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
