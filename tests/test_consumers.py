"""Each export, read by the consumers docs/exports.md names for it, trains on what was generated and on nothing else.

The job is tests/test_export_formats.py's (:func:`store_job`: submitted for real, nine rows — plain, tool-calling,
after a tool result, one cut inside its reasoning). The consumers — SpecForge 0.2.0, speculators 0.9.0, TRL 1.16
with datasets 5.1.0 — need torch and pins of their own, so they live in a venv of their own: ``bash
scripts/consumers.sh env`` builds it from ``scripts/consumers/consumers.lock`` once (minutes) and prints its python
(``THINKFLEET_CONSUMERS_VENV`` names another venv instead). One process in it (``scripts/consumers/check.py``) runs
every consumer on the export meant for it and reports each row as the consumer would train it; the tests here judge
that, token by token, with :func:`training_problems`. A venv that cannot be built skips them on a developer's
machine and FAILS them under CI.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_export_formats import JOB, store_job, tok, tok_dir  # noqa: F401 - the job and its tokenizer fixtures

from storage.exports import base as export_base
from storage.exports import export_job
from storage.exports.base import (
    SPECFORGE_MAX_LENGTH,
    SPECULATORS_SEQ_LENGTH,
    TRL_MAX_LENGTH,
    ExportResult,
    LengthCheck,
)
from storage.reader import read_committed
from storage.writer import PartWriter
from testing.harness import isolated_settings
from testing.rows import make_row
from testing.services import RedisServer, service_missing
from thinkfleet import kimi
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
VENV_ENV = "THINKFLEET_CONSUMERS_VENV"
#: A trainer's label for a token that carries no loss (PyTorch cross-entropy's ignore_index, TRL's and HF's).
NO_LOSS = -100
#: The first test also waits for the venv (built once per lock file: ≈ 2 min here, more on a loaded box).
pytestmark = pytest.mark.timeout(1800)


# -- the judge ---------------------------------------------------------------------------------------------------
def training_problems(
    prompt: Sequence[int], output: Sequence[int], input_ids: Sequence[int], labels: Sequence[int], trained_from: int = 0
) -> list[str]:
    """What is wrong with how a consumer would train one stored row; [] when nothing.

    ``input_ids`` and ``labels`` are the row as the consumer holds it (``labels``: the token's id where it carries
    loss, :data:`NO_LOSS` where not). They must be the stored ``prompt + output`` ids, with loss on every output
    token from ``trained_from`` on (0: all of them; the end of the reasoning block under ``--exclude-reasoning``)
    and on nothing else: no prompt token. An output token cut off by the consumer counts as missed."""
    stored = [*prompt, *output]
    problems = []
    if list(input_ids) != stored:
        pairs = enumerate(zip(input_ids, stored, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(input_ids), len(stored)))
        problems.append(
            f"ids differ from the stored ids from position {at} ({len(input_ids)} ids, {len(stored)} stored)"
        )
    if len(labels) != len(input_ids):
        problems.append(f"{len(labels)} labels for {len(input_ids)} ids")
    start = len(prompt) + trained_from
    trained = [i < len(labels) and labels[i] != NO_LOSS for i in range(len(stored))]
    found = {
        "prompt tokens trained": [i for i in range(len(prompt)) if trained[i]],
        "generated tokens not trained": [i for i in range(start, len(stored)) if not trained[i]],
        "generated tokens trained that should not be": [i for i in range(len(prompt), start) if trained[i]],
        "labels that are not the token's id": [
            i for i in range(min(len(labels), len(input_ids))) if trained[i] and labels[i] != input_ids[i]
        ],
    }
    problems += [f"{len(at)} {what} (first at {at[0]})" for what, at in found.items() if at]
    return problems


def labels_of(input_ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    """A loss mask (1: trained) as a trainer's labels."""
    return [token if bit else NO_LOSS for token, bit in zip(input_ids, mask, strict=True)]


def test_the_judge_refuses_a_mask_that_trains_the_prompt_or_misses_a_generated_token() -> None:
    prompt, output = [11, 12, 13], [21, 22, 23]
    ids = prompt + output
    assert training_problems(prompt, output, ids, labels_of(ids, [0, 0, 0, 1, 1, 1])) == []
    (problem,) = training_problems(prompt, output, ids, labels_of(ids, [0, 0, 1, 1, 1, 1]))
    assert problem == "1 prompt tokens trained (first at 2)"
    (problem,) = training_problems(prompt, output, ids, labels_of(ids, [0, 0, 0, 1, 0, 1]))
    assert problem == "1 generated tokens not trained (first at 4)"
    # Every token trained (what TRL does with a column it does not read), and a consumer that cut the row's tail.
    assert training_problems(prompt, output, ids, ids) == ["3 prompt tokens trained (first at 0)"]
    cut = training_problems(prompt, output, ids[:5], labels_of(ids[:5], [0, 0, 0, 1, 1]))
    assert cut == [
        "ids differ from the stored ids from position 5 (5 ids, 6 stored)",
        "1 generated tokens not trained (first at 5)",
    ]
    # --exclude-reasoning: the first output token is reasoning, left out of the loss.
    assert training_problems(prompt, output, ids, labels_of(ids, [0, 0, 0, 0, 1, 1]), trained_from=1) == []
    assert training_problems(prompt, output, ids, labels_of(ids, [0, 0, 0, 1, 1, 1]), trained_from=1) == [
        "1 generated tokens trained that should not be (first at 3)"
    ]
    assert training_problems(prompt, output, ids, [NO_LOSS] * 3 + [21, 99, 23]) == [
        "1 labels that are not the token's id (first at 4)"
    ]


# -- the consumers' venv, and what they saw ----------------------------------------------------------------------
def consumers_python() -> Path:
    """The consumers' python: ``THINKFLEET_CONSUMERS_VENV``'s, or the venv scripts/consumers.sh builds (or reuses)."""
    if os.environ.get(VENV_ENV):
        python = Path(os.environ[VENV_ENV]) / "bin" / "python"
        if not python.exists():
            service_missing(f"{VENV_ENV}={os.environ[VENV_ENV]} has no bin/python")
        return python
    try:
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "consumers.sh"), "env"], capture_output=True, text=True, timeout=1500
        )
    except subprocess.TimeoutExpired as exc:
        service_missing(f"`bash scripts/consumers.sh env` did not finish in {exc.timeout} s")
    if done.returncode != 0:
        service_missing(f"`bash scripts/consumers.sh env` failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class Seen:
    """The job as stored, and each row as the consumers would train it (scripts/consumers/check.py's report)."""

    expected: dict[str, dict[str, Any]]  # prompt_id → prompt, output, reply, finish (store_job's)
    stored: dict[str, dict[str, Any]]  # prompt_id → the committed row (its spans)
    report: dict[str, Any]
    exports: dict[str, ExportResult]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tok_dir: Path, tok: Any) -> Seen:  # noqa: F811
    python = consumers_python()
    tmp = tmp_path_factory.mktemp("consumers")
    settings = isolated_settings(redis_server.url(0), str(tmp / "store"))
    expected = store_job(settings, tmp, tok_dir, tok)
    stored = {r["prompt_id"]: r for r in read_committed(settings.output_uri, JOB).to_pylist()}
    paths = {
        "specforge": tmp / "sf.jsonl",
        "conversations": tmp / "conversations.jsonl",
        "hf": tmp / "hf",
        "hf_exclude_reasoning": tmp / "hf-exclude-reasoning",
        "messages": tmp / "messages.jsonl",
        "eagle3_parquet": tmp / "eagle3.parquet",
    }
    exports = {
        "specforge": export_job(settings, JOB, "specforge", str(paths["specforge"])),
        "conversations": export_job(
            settings, JOB, "conversations", str(paths["conversations"]), tokenizer=str(tok_dir)
        ),
        "hf": export_job(settings, JOB, "hf", str(paths["hf"])),
        "hf_exclude_reasoning": export_job(
            settings, JOB, "hf", str(paths["hf_exclude_reasoning"]), exclude_reasoning=True
        ),
        "messages": export_job(settings, JOB, "messages", str(paths["messages"]), tokenizer=str(tok_dir)),
        "eagle3": export_job(settings, JOB, "eagle3", str(paths["eagle3_parquet"])),
    }
    spec = tmp / "spec.json"
    spec.write_text(
        json.dumps({"work": str(tmp / "work"), "tokenizer": str(tok_dir), **{k: str(v) for k, v in paths.items()}})
    )
    report = tmp / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Offline, caches inside the test's directory, one thread each: a guest on a shared box.
    env.update(HF_HOME=str(tmp / "hf-home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [str(python), "-W", "ignore", str(REPO / "scripts" / "consumers" / "check.py"), str(spec), str(report)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return Seen(expected, stored, json.loads(report.read_text()), exports)


def _by_stored_ids(seen: Seen, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A consumer's rows (which carry no id) → prompt_id, by their ids; each stored row must appear once."""
    ours = {tuple(want["prompt"] + want["output"]): pid for pid, want in seen.expected.items()}
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        pid = ours.get(tuple(row["input_ids"]))
        assert pid is not None, f"a row that is no stored row: {row['input_ids'][:20]}…"
        assert pid not in out, f"{pid} twice"
        out[pid] = row
    assert set(out) == set(seen.expected)
    return out


def _judge(
    seen: Seen, rows: dict[str, dict[str, Any]], trained_from: dict[str, int] | None = None
) -> dict[str, list[str]]:
    """prompt_id → :func:`training_problems` of that row as a consumer holds it (``input_ids`` + ``labels``)."""
    return {
        pid: training_problems(
            seen.expected[pid]["prompt"],
            seen.expected[pid]["output"],
            row["input_ids"],
            row["labels"],
            (trained_from or {}).get(pid, 0),
        )
        for pid, row in rows.items()
    }


# -- specforge / eagle3 -------------------------------------------------------------------------------------------
def test_specforge_and_speculators_train_the_specforge_export_as_stored(seen: Seen) -> None:
    for consumer in ("specforge", "speculators"):
        rows = _by_stored_ids(seen, seen.report[consumer])
        labelled = {pid: {**r, "labels": labels_of(r["input_ids"], r["loss_mask"])} for pid, r in rows.items()}
        assert _judge(seen, labelled) == {pid: [] for pid in seen.expected}, consumer


def test_the_eagle3_parquet_is_for_a_loader_of_your_own(seen: Seen) -> None:
    """SpecForge's prompt builder reads any file as JSON lines: the Parquet is no input of its (docs say so)."""
    assert seen.report["specforge_on_eagle3_parquet"].startswith("UnicodeDecodeError"), seen.report


def test_specforge_text_route_loses_the_reasoning_and_the_ids(seen: Seen, tok: Any) -> None:  # noqa: F811
    """The conversations export loads in SpecForge's text route, and loses what docs/exports.md says it loses:
    only final turns with tool calls keep their reasoning in the trained tokens, and no row keeps its ids."""
    rows = seen.report["specforge_text_route"]
    assert len(rows) == len(seen.expected)
    stored = [want["prompt"] + want["output"] for want in seen.expected.values()]
    assert sum(r["input_ids"] in stored for r in rows) == 0
    trained = [
        tok.decode([i for i, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m], skip_special_tokens=False)
        for r in rows
    ]
    kept = sorted(
        pid for pid, want in seen.expected.items() if any(want["reply"]["reasoning_content"] in t for t in trained)
    )
    with_calls = sorted(pid for pid, want in seen.expected.items() if "tool_calls" in want["reply"])
    assert kept == with_calls == ["chat/tool0", "chat/tool1"]


def test_the_conversations_export_is_specforges_alone(seen: Seen) -> None:
    """speculators renders conversations only through a vLLM render endpoint; TRL reads no ``conversations`` key."""
    found = seen.report["conversations_elsewhere"]
    assert found["speculators"].startswith("ValueError: render_endpoint is required"), found
    assert found["trl"] == "KeyError: 'text'", found


# -- hf -----------------------------------------------------------------------------------------------------------
def test_trl_trains_the_hf_export_on_every_generated_token_and_no_prompt_token(seen: Seen) -> None:
    """datasets' load_from_disk gives the rows exactly; TRL's SFTTrainer with its DEFAULT settings builds labels from
    ``assistant_masks``, and its collator's batch trains exactly the generated tokens of every row."""
    hf = seen.report["hf"]
    assert {"input_ids", "assistant_masks", "loss_mask"} <= set(hf["columns"])
    for pid, want in seen.expected.items():
        row = hf["loaded"][pid]
        assert row["input_ids"] == want["prompt"] + want["output"]
        assert row["assistant_masks"] == row["loss_mask"] == [0] * len(want["prompt"]) + [1] * len(want["output"])
    assert set(hf["trl"]) == set(seen.expected)
    assert _judge(seen, hf["trl"]) == {pid: [] for pid in seen.expected}


def test_trl_honours_the_hf_mask_left_by_exclude_reasoning(seen: Seen) -> None:
    """Under --exclude-reasoning the loss starts after the stored reasoning block (through ``</think>``); a row with
    nothing left to train (cut inside its reasoning) TRL drops."""
    trained_from = {pid: row["reasoning_end"] + row["has_think_end"] for pid, row in seen.stored.items()}
    nothing_left = {pid for pid, start in trained_from.items() if start == len(seen.expected[pid]["output"])}
    assert nothing_left == {"chat/plain4"}
    trl = seen.report["hf_exclude_reasoning"]["trl"]
    assert set(trl) == set(seen.expected) - nothing_left
    assert _judge(seen, trl, trained_from) == {pid: [] for pid in trl}


# -- messages -----------------------------------------------------------------------------------------------------
def test_trl_trains_the_messages_export_on_every_token_as_docs_say(seen: Seen) -> None:
    """What docs/exports.md says of TRL on the messages export, measured: as it is, TRL trains every token, the
    user's and the system's included, re-rendered (a plain final turn loses its reasoning); assistant_only_loss
    refuses a template without ``{% generation %}`` markers (Kimi's); mapped to prompt/completion, only the rows
    whose final turn calls a tool train exactly their generated tokens."""
    messages = seen.report["messages"]
    as_is = messages["as_is"]
    assert set(as_is) == set(seen.expected)
    for pid, row in as_is.items():
        assert row["labels"] == row["input_ids"], pid  # every token carries loss
        assert any("prompt tokens trained" in p for p in _judge(seen, {pid: row})[pid])
    assert "generation" in messages["assistant_only_loss"] and messages["assistant_only_loss"].startswith("ValueError")
    pairs = _judge(seen, messages["prompt_completion"])
    assert sorted(pid for pid, problems in pairs.items() if not problems) == ["chat/tool0", "chat/tool1"]
    for pid, want in seen.expected.items():
        row = messages["prompt_completion"][pid]
        trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != NO_LOSS]
        if pid.startswith("chat/plain") and want["finish"] == "stop":
            # the prompt untouched, then </think> + answer + <|im_end|>: the reasoning is gone
            assert row["input_ids"][: len(want["prompt"])] == want["prompt"]
            assert trained == want["output"][want["output"].index(kimi.THINK_END) :], pid
    # After a tool result the template re-renders the history, so TRL's completion starts inside the prompt.
    assert any("prompt tokens trained" in p for p in pairs["chat/after-tool"]), pairs["chat/after-tool"]


# -- lengths ------------------------------------------------------------------------------------------------------
def test_each_format_warns_at_the_default_length_of_its_consumer(seen: Seen) -> None:
    assert seen.report["defaults"] == {
        "trl_max_length": TRL_MAX_LENGTH,
        "specforge_max_length": SPECFORGE_MAX_LENGTH,
        "speculators_seq_length": SPECULATORS_SEQ_LENGTH,
    }
    limits = {name: result.max_length for name, result in seen.exports.items()}
    assert limits == {
        "specforge": SPECFORGE_MAX_LENGTH,
        "conversations": SPECFORGE_MAX_LENGTH,
        "hf": TRL_MAX_LENGTH,
        "hf_exclude_reasoning": TRL_MAX_LENGTH,
        "messages": TRL_MAX_LENGTH,
        "eagle3": SPECFORGE_MAX_LENGTH,
    }


@pytest.fixture
def long_rows(redis_url: str, tmp_path: Path) -> Settings:
    """A job of rows 500, 1,500 and 3,000 tokens long (id rows: the token formats need no tokenizer)."""
    settings = isolated_settings(redis_url, str(tmp_path / "store"))
    rows = [
        make_row(f"r-{n}", job="long", input_ids=list(range(100, 100 + n // 2)), output_ids=[7] * (n - n // 2))
        for n in (500, 1500, 3000)
    ]
    PartWriter(settings.output_uri, "w1").write("long", "ds", rows)
    return settings


def test_rows_over_a_consumers_limit_are_named_longest_first(long_rows: Settings, tmp_path: Path) -> None:
    hf = export_job(long_rows, "long", "hf", str(tmp_path / "hf"))
    assert (hf.max_length, hf.over_max_length, hf.over_max_length_ids) == (1024, 2, ["r-3000", "r-1500"])
    (warning,) = [w for w in hf.warnings if "tokens (longest" in w]  # (the others: provenance's)
    assert warning.startswith("2 of 3 rows are longer than 1024 tokens (longest 3000): r-3000, r-1500. TRL's")
    specforge = export_job(long_rows, "long", "specforge", str(tmp_path / "sf.jsonl"))
    assert (specforge.max_length, specforge.over_max_length_ids) == (2048, ["r-3000"])
    assert any("data.max_length=3000 / --seq-length 3000" in w for w in specforge.warnings)
    eagle3 = export_job(long_rows, "long", "eagle3", str(tmp_path / "e.parquet"), max_length=400)
    assert (eagle3.max_length, eagle3.over_max_length_ids) == (400, ["r-3000", "r-1500", "r-500"])


def test_the_length_check_keeps_the_longest_ids_whatever_the_export_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_base, "LONG_ROWS_KEPT", 3)
    monkeypatch.setattr(export_base, "LONG_ROWS_NAMED", 2)
    check = LengthCheck(10)
    for batch in range(20):
        lengths = np.arange(batch, batch + 5)  # the longest rows come last
        check.add([f"b{batch}-{i}" for i in range(5)], lengths * 2)
        assert len(check._named) <= 2 * 3
    result = ExportResult(path="x", format="hf", rows=100)
    check.report(result, "raise it to {longest}")
    assert result.over_max_length_ids == ["b19-4", "b18-4", "b19-3"]
    assert result.over_max_length == sum(int((np.arange(b, b + 5) * 2 > 10).sum()) for b in range(20))
    more = result.over_max_length - 2
    assert result.warnings[0].endswith(f"b19-4, b18-4 and {more} more (--json lists the 3 longest). raise it to 46")
