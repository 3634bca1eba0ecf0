"""The job file: ``producer submit job.yaml`` — every dataset of a job, each with its own columns,
samples and sampling, in one validated file.

Keys mirror the ``submit`` flags in snake_case (MISSION.md, "Job file")::

    job: k25-eagle3
    tokenizer: /models/kimi-k2.5
    trust_remote_code: true
    sampling: {max_new_tokens: 10240, temperature: 1.0, top_p: 0.95}
    datasets:
      - {path: data/chat.jsonl, name: chat}
      - {path: data/questions.parquet, name: questions, prompt_column: question,
         sampling: {max_new_tokens: 2048}}

The whole file is validated (:class:`JobFile`, unknown keys refused) before anything is read or
enqueued; every problem is reported at once as ``FILE: key.path: what; fix`` (an unknown key names
the closest known one). Relative paths are read relative to the file's directory (then the working
directory); a ``path`` that is no file may be a Hugging Face dataset id, read from the local cache.
Flags given on the command line next to the file override its top-level values
(:func:`apply_flags`); the resolved file is kept in the job record (``JobRecord.job_file``).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from producer.inputs import S3_SCHEMES, Columns, dataset_name
from producer.submit_options import DatasetOptions
from thinkfleet.message import is_plain_name

#: File suffixes ``producer submit`` reads as a job file.
JOB_FILE_SUFFIXES = (".yaml", ".yml")

#: submit flag (click parameter name) → the job file key it sets.
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "job": ("job",),
    "tokenizer": ("tokenizer",),
    "trust_remote_code": ("trust_remote_code",),
    "model_family": ("model_family",),
    "chat_template_kwargs": ("chat_template_kwargs",),
    "turns": ("turns",),
    "tool_results": ("tool_results",),
    "tool_mismatch": ("tool_mismatch",),
    "max_tool_steps": ("max_tool_steps",),
    "tool_executor": ("tool_executor",),
    "samples": ("samples",),
    "context_length": ("context_length",),
    "max_prompt_tokens": ("max_prompt_tokens",),
    "expect_model": ("expect_model",),
    "skip_invalid": ("skip_invalid",),
    "think_start_id": ("think_start_id",),
    "think_end_id": ("think_end_id",),
    "max_new_tokens": ("sampling", "max_new_tokens"),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "top_k": ("sampling", "top_k"),
    "min_p": ("sampling", "min_p"),
    "seed": ("sampling", "seed"),
    "stop_token_ids": ("sampling", "stop_token_ids"),
    "logprobs": ("logprobs",),
}
#: submit flags that describe one input: a job file sets them per dataset instead.
DATASET_FLAGS: dict[str, str] = {
    "dataset_names": "name",
    "messages_column": "messages_column",
    "conversations_column": "conversations_column",
    "prompt_column": "prompt_column",
    "system_column": "system_column",
    "tools_column": "tools_column",
    "id_column": "id_column",
    "split": "split",
}


class JobFileError(Exception):
    """The job file is unusable; ``problems`` are its lines, each ``FILE: key.path: what; fix``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    """SGLang sampling, as the flags name it (``seed`` → ``sampling_seed``). Unset keys: the job's value."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(t < 0 for t in value)):
            raise ValueError("a non-empty list of token ids (integers ≥ 0)")
        return value


class DatasetEntry(_Strict):
    """One input: a file or directory (local or ``s3://``), or a hub dataset id, with its own options."""

    path: str = Field(min_length=1)
    name: str | None = None
    split: str | None = None
    messages_column: str | None = None
    conversations_column: str | None = None
    prompt_column: str | None = None
    system_column: str | None = None
    tools_column: str | None = None
    #: a stable row id column; "" = row numbers; unset = "id" when the rows have one
    id_column: str | None = None
    #: a column of images (docs/vision.md); "" = none; unset = "images" or "image" when the rows have one
    images_column: str | None = None
    samples: int | None = Field(None, ge=1)
    sampling: Sampling | None = None

    @field_validator("name")
    @classmethod
    def _plain(cls, value: str | None) -> str | None:
        if value is not None and not is_plain_name(value):
            raise ValueError(
                "a dataset name is letters, digits, '.', '_', '-' (at most 128, starting with a letter or digit)"
            )
        return value

    @model_validator(mode="after")
    def _one_layout(self) -> DatasetEntry:
        named = [k for k in ("messages_column", "conversations_column", "prompt_column") if getattr(self, k)]
        if len(named) > 1:
            raise ValueError(f"set one of messages_column, conversations_column, prompt_column, not {named}")
        return self


class JobFile(_Strict):
    job: str
    tokenizer: str = Field(min_length=1)
    trust_remote_code: bool = False
    model_family: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    turns: Literal["last", "all"] = "last"
    #: With ``turns: all``: ``replay`` regenerates through tool calls with the dataset's recorded results.
    tool_results: Literal["replay", "executor"] | None = None
    #: ``tool_results: executor``: ``module:function``, ``file.py:function`` or an http(s) URL.
    tool_executor: str | None = None
    tool_mismatch: Literal["chain_end", "keep_recorded"] = "chain_end"
    max_tool_steps: int = Field(8, ge=1)
    sampling: Sampling = Field(default_factory=Sampling)
    samples: int = Field(1, ge=1)
    priority: int = 0
    context_length: int | None = Field(None, ge=2)
    max_prompt_tokens: int | None = Field(None, ge=1)
    expect_model: str | None = None
    skip_invalid: bool = False
    think_start_id: int | None = Field(None, ge=0)
    think_end_id: int | None = Field(None, ge=0)
    #: ``--logprobs K``: the sampled token's logprob and the top-K alternatives per output token
    logprobs: int | None = Field(None, ge=0)
    datasets: list[DatasetEntry] = Field(min_length=1)

    @field_validator("job")
    @classmethod
    def _plain(cls, value: str) -> str:
        if not is_plain_name(value):
            raise ValueError(
                "a job name is letters, digits, '.', '_', '-' (at most 128, starting with a letter or digit)"
            )
        return value


def is_job_file(paths: list[Path] | tuple[Path, ...]) -> bool:
    """``submit`` was given one ``.yaml``/``.yml`` argument: a job file, not a dataset."""
    return len(paths) == 1 and Path(paths[0]).suffix.lower() in JOB_FILE_SUFFIXES


def load(path: str | Path) -> JobFile:
    """Read and validate a job file; relative paths resolved, default dataset names filled and checked."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise JobFileError([f"{path}: cannot read it ({e.strerror or e})"]) from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e)
        raise JobFileError([f"{where}: not valid YAML ({what}); fix the syntax"]) from None
    if not isinstance(raw, dict):
        raise JobFileError(
            [f"{path}: the top level is {type(raw).__name__ if raw is not None else 'empty'}, not a mapping; "
             "start with `job: NAME`, `tokenizer: PATH` and `datasets: [...]`"]
        )  # fmt: skip
    try:
        jf = JobFile.model_validate(raw)
    except ValidationError as e:
        raise JobFileError(describe(e, str(path))) from None
    return _resolve(jf, path)


def _resolve(jf: JobFile, path: Path) -> JobFile:
    base = path.parent
    problems: list[str] = []
    entries: list[DatasetEntry] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(jf.datasets):
        given = entry.path
        resolved = _relative_to(base, given)
        name = entry.name or dataset_name(resolved)
        if entry.name is None and not is_plain_name(name):
            problems.append(
                f"{path}: datasets[{i}].path: the default name {name!r} (from {given}) is not plain; "
                "set `name:` (letters, digits, '.', '_', '-')"
            )
        if name in seen:
            problems.append(
                f"{path}: datasets[{i}].name: {name!r} is also datasets[{seen[name]}]'s name; give each a distinct "
                "`name:` (it is the dataset's partition in the output)"
            )
        seen.setdefault(name, i)
        entries.append(entry.model_copy(update={"path": resolved, "name": name}))
    if problems:
        raise JobFileError(problems)
    return jf.model_copy(update={"datasets": entries, "tokenizer": _relative_to(base, jf.tokenizer)})


def _relative_to(base: Path, given: str) -> str:
    """A relative path that exists next to the job file is read there; anything else stays as given (an
    absolute path, an ``s3://`` URI, a path from the working directory, a hub id)."""
    if given.startswith((*S3_SCHEMES, "file://")) or Path(given).is_absolute():
        return given
    candidate = base / given
    return str(candidate) if candidate.exists() else given


def apply_flags(jf: JobFile, given: dict[str, Any], path: str | Path) -> JobFile:
    """Flags given on the command line override the file's top-level values (re-validated)."""
    data = jf.model_dump()
    for flag, value in given.items():
        keys = FLAG_KEYS.get(flag)
        if keys is None:
            continue
        if flag == "chat_template_kwargs" and isinstance(value, str):
            try:
                value = {**data["chat_template_kwargs"], **json.loads(value)}
            except (ValueError, TypeError) as e:
                raise JobFileError([f"--chat-template-kwargs: not a JSON object ({e})"]) from None
        if flag == "stop_token_ids" and isinstance(value, str):
            try:
                value = [int(t) for t in value.replace(" ", "").split(",") if t]
            except ValueError:
                raise JobFileError(["--stop-token-ids: comma-separated integers, e.g. 163586,163585"]) from None
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    try:
        return JobFile.model_validate(data)
    except ValidationError as e:
        raise JobFileError(describe(e, f"{path} (with the flags given)")) from None


def submit_flags(jf: JobFile, available: set[str], path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The file's top-level values as the ``submit`` command's flags (what ``producer.submit_cmd`` builds its
    options from), and warnings. A key this producer has no flag for is kept in the job record only
    (with a warning)."""
    flags: dict[str, Any] = {}
    warnings: list[str] = []
    for flag, keys in FLAG_KEYS.items():
        value: Any = jf
        for key in keys:
            value = getattr(value, key)
        if flag not in available:
            if flag == "turns" and value != "last":
                raise JobFileError(
                    [f"{path}: turns: {value!r} is not supported yet (multi-turn rows); use `turns: last`"]
                )
            if flag == "model_family" and value is not None:
                warnings.append(
                    f"{path}: model_family {value!r} is kept in the job record; this producer renders with the "
                    "tokenizer's own chat template"
                )
            continue
        if flag == "chat_template_kwargs":
            value = json.dumps(value) if value else None
        elif flag == "stop_token_ids":
            value = ",".join(map(str, value)) if value else None
        flags[flag] = value
    return flags, warnings


def dataset_options(jf: JobFile) -> list[DatasetOptions]:
    """One :class:`DatasetOptions` per ``datasets`` entry (names and paths already resolved by :func:`load`)."""
    out = []
    for entry in jf.datasets:
        columns = Columns(
            messages=entry.messages_column,
            conversations=entry.conversations_column,
            prompt=entry.prompt_column,
            system=entry.system_column,
            tools=entry.tools_column,
            id="id" if entry.id_column is None else entry.id_column,
            images=entry.images_column,
        )
        sampling = entry.sampling.model_dump(exclude_none=True) if entry.sampling else {}
        out.append(DatasetOptions(entry.path, entry.name, columns, entry.split, entry.samples, sampling))
    return out


def resolved(jf: JobFile) -> dict[str, Any]:
    """The file as it runs (unset keys dropped, defaults kept), for the job record; ``producer submit``
    fills in the template switches, model family and sampling in effect."""
    return _drop_none(jf.model_dump(mode="json"))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


# -- error messages ----------------------------------------------------------------------------------
def describe(error: ValidationError, where: str) -> list[str]:
    """Each validation error as ``WHERE: key.path: what; fix``."""
    out = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        key = _key_path(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            out.append(f"{where}: {key}: unknown key; {_closest(loc)}")
        elif kind == "missing":
            out.append(f"{where}: {key}: required; add it{_example(loc)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
            out.append(f"{where}: {key or '(top level)'}: {msg}{shown}; {_fix(loc, kind)}")
    return out


def _key_path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("function-after", "function-before"):  # pydantic's validator frames, not keys
            continue
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose keys live at ``loc`` (list indexes and optionals seen through)."""
    model: type[BaseModel] | None = JobFile
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _inner_model(model.model_fields[part].annotation)
    return model


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (typing.Union, list):
        for arg in typing.get_args(annotation):
            found = _inner_model(arg)
            if found is not None:
                return found
    return None


def _closest(loc: tuple[Any, ...]) -> str:
    unknown, parent = str(loc[-1]), loc[:-1]
    model = _model_at(parent)
    known = sorted(model.model_fields) if model is not None else []
    if model is JobFile and unknown in Sampling.model_fields:
        return f"it is a sampling key: put it under `sampling:` (sampling: {{{unknown}: …}})"
    if model is JobFile and unknown in DatasetEntry.model_fields:
        return f"it is set per dataset: put it in each `datasets:` entry ({unknown}: …)"
    if model is DatasetEntry and unknown in Sampling.model_fields:
        return f"it is a sampling key: put it under this dataset's `sampling:` (sampling: {{{unknown}: …}})"
    match = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
    if match:
        return f"did you mean `{match[0]}`?"
    return f"known keys: {', '.join(known)}"


_EXAMPLES = {"job": "job: my-job", "tokenizer": "tokenizer: /models/kimi-k2.5", "path": "path: data/chat.jsonl",
             "datasets": "datasets: [{path: data/chat.jsonl}]"}  # fmt: skip


def _example(loc: tuple[Any, ...]) -> str:
    example = _EXAMPLES.get(str(loc[-1]))
    return f", e.g. `{example}`" if example else ""


#: What a value should be, by key: the fix for a value that is out of range or of the wrong type.
_EXPECTED = {
    "max_new_tokens": "the generation budget in tokens, e.g. 2048",
    "temperature": "a number ≥ 0, e.g. 1.0",
    "top_p": "a probability in (0, 1], e.g. 0.95",
    "top_k": "-1 (no limit) or a count ≥ 1, e.g. 20",
    "min_p": "a probability in [0, 1], e.g. 0.0",
    "seed": "an integer, e.g. 7",
    "stop_token_ids": "a list of token ids, e.g. [163586]",
    "samples": "generations per row, ≥ 1",
    "priority": "an integer",
    "context_length": "the servers' --context-length in tokens, e.g. 262144",
    "max_prompt_tokens": "a token count ≥ 1",
    "think_start_id": "a token id ≥ 0",
    "think_end_id": "a token id ≥ 0",
    "logprobs": "the number of top alternatives per output token ≥ 0, e.g. 5 (0: the sampled token's only)",
    "turns": "`last` (regenerate the last assistant turn) or `all`",
    "tool_results": "`replay` (the dataset's recorded tool results) or `executor` (needs `turns: all`)",
    "tool_executor": "module:function, path/to/file.py:function or an http(s) URL",
    "tool_mismatch": "`chain_end` or `keep_recorded`",
    "max_tool_steps": "a count ≥ 1, e.g. 8",
    "trust_remote_code": "true or false",
    "skip_invalid": "true or false",
    "chat_template_kwargs": "a mapping, e.g. {thinking: true}",
}


def _fix(loc: tuple[Any, ...], kind: str) -> str:
    last = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    if last == "datasets" and kind == "too_short":
        return "list at least one dataset, e.g. `datasets: [{path: data/chat.jsonl}]`"
    if last in _EXPECTED:
        return f"expected {_EXPECTED[last]}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "give a whole number"
    if kind in ("float_type", "float_parsing"):
        return "give a number"
    if kind in ("bool_type", "bool_parsing"):
        return "give true or false"
    if kind in ("string_type",):
        return "give a text value (quote it if YAML reads it as something else)"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "give a mapping (key: value lines, or {key: value})"
    if kind == "list_type":
        return "give a list ([a, b] or '- ' lines)"
    if kind == "literal_error":
        return "use one of the values listed"
    return "fix the value"
