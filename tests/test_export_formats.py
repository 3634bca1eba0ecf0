"""``producer export --format hf|messages|conversations|specforge|eagle3``: exports that train as they are.

The job here is submitted for real (``producer submit`` with the Kimi-shaped test tokenizer, so the
manifest keeps each prompt's source conversation), and its rows are what a worker would store: outputs
tokenized from known reasoning, answer and tool-call text, ending in ``<|im_end|>``. Then each format is
read back the way its consumer reads it.

The consumers themselves (SpecForge, speculators, TRL) pull torch and pin versions of their own, so they
run in a venv of their own, on the same job (:func:`store_job`): tests/test_consumers.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_storage_s3 import BUCKET, s3_endpoint  # noqa: F401 - the local S3 (moto) fixture

from producer import render
from producer.submit import submit
from producer.submit_options import SubmitOptions
from storage.cli import export, report
from storage.exports import SPECFORGE_MAX_LENGTH, ExportError, export_job
from storage.exports import hf as export_module
from storage.manifest import read_sources
from storage.reader import read_committed
from storage.writer import PartWriter
from testing.datasets import write_jsonl
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.settings import Settings

JOB = "kx"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY_CALL = {"id": "functions.get_weather:0", "type": "function"}
HISTORY_CALL["function"] = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def _inputs() -> list[dict[str, Any]]:
    """Plain chats, chats that declare a tool, and one that continues after a tool result."""
    rows: list[dict[str, Any]] = []
    for i in range(6):
        messages = [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Question {i}: how far is the moon, in plain words?"},
            {"role": "assistant", "content": "An old answer that submit drops."},
        ]
        rows.append({"id": f"plain{i}", "messages": messages, "tools": None})  # the first row names the columns
    for i in range(2):
        rows.append(
            {
                "id": f"tool{i}",
                "messages": [{"role": "user", "content": f"What is the weather in Paris, day {i}?"}],
                "tools": TOOLS,
            }
        )
    rows.append(
        {
            "id": "after-tool",
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "I should call.",
                    "tool_calls": [HISTORY_CALL],
                },
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 3}'},
            ],
            "tools": TOOLS,
        }
    )
    return rows


def _generation(tok: Any, pid: str, i: int) -> tuple[list[int], dict[str, Any], str]:
    """What the model 'emitted' for a prompt: output ids, the message they mean, and finish_reason."""

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    reasoning = f"The user asks about {pid}. I think step {i} first, then answer."
    answer = f"Here is the answer for {pid}."
    if pid.endswith("plain4"):  # truncated inside reasoning: no </think>, no stop token
        return ids(reasoning), {"reasoning_content": reasoning, "content": ""}, "length"
    if pid.endswith("plain5"):  # a very short reasoning
        reasoning = "Easy."
    out = [*ids(reasoning), kimi.THINK_END, *ids(answer)]
    message: dict[str, Any] = {"reasoning_content": reasoning, "content": answer}
    if "tool" in pid and "after" not in pid:
        arguments = '{"city": "Paris"}'
        out += [kimi.TOOL_CALLS_SECTION_BEGIN, kimi.TOOL_CALL_BEGIN, *ids("functions.get_weather:0")]
        out += [kimi.TOOL_CALL_ARGUMENT_BEGIN, *ids(arguments), kimi.TOOL_CALL_END, kimi.TOOL_CALLS_SECTION_END]
        call = {"id": "functions.get_weather:0", "type": "function"}
        message["tool_calls"] = [{**call, "function": {"name": "get_weather", "arguments": arguments}}]
    return [*out, kimi.IM_END], message, "stop"


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Any:
    return render.load_tokenizer(str(tok_dir))


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "store"))


@pytest.fixture
def job(settings: Settings, tmp_path: Path, tok_dir: Path, tok: Any) -> dict[str, dict[str, Any]]:
    return store_job(settings, tmp_path, tok_dir, tok)


def store_job(settings: Settings, tmp_path: Path, tok_dir: Path, tok: Any) -> dict[str, dict[str, Any]]:
    """Submit the inputs for real, then store one generation per prompt; prompt_id → what is expected."""
    path = write_jsonl(tmp_path / "chat.jsonl", _inputs())
    submit(settings, SubmitOptions(paths=[path], job=JOB, tokenizer=str(tok_dir), processes=1))
    sources = read_sources(settings.output_uri, JOB)
    expected: dict[str, dict[str, Any]] = {}
    rows = []
    for i, ((pid, digest), (messages_json, tools_json)) in enumerate(sorted(sources.items())):
        messages, tools = json.loads(messages_json), json.loads(tools_json) if tools_json else None
        prompt = render.render_ids(tok, messages, tools, {"thinking": True})
        assert render.content_hash(np.asarray(prompt, dtype="<u4")) == digest  # the manifest renders the prompt
        output, reply, finish = _generation(tok, pid, i)
        finish_reason = {"type": "stop", "matched": kimi.IM_END} if finish == "stop" else {"type": "length"}
        rows.append(
            make_row(
                pid,
                dataset="chat",
                job=JOB,
                input_ids=prompt,
                output_ids=output,
                content_hash=digest,
                finish_reason=finish_reason,
            )
        )
        expected[pid] = {"messages": messages, "tools": tools, "reply": reply, "prompt": prompt, "output": output}
        expected[pid]["finish"] = finish
    PartWriter(settings.output_uri, "w1").write(JOB, "chat", rows)
    return expected


def _lines(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# -- the source conversation is kept at submit ------------------------------------------------------------------
def test_submit_keeps_each_prompts_source_conversation_in_the_manifest(settings, job) -> None:
    sources = read_sources(settings.output_uri, JOB)
    by_id = {pid: json.loads(m) for (pid, _), (m, _t) in sources.items()}
    assert set(by_id) == set(job) and len(job) == 9
    # Cut after the last user/tool turn, exactly as the template rendered it.
    assert by_id["chat/plain0"] == [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Question 0: how far is the moon, in plain words?"},
    ]
    assert [m["role"] for m in by_id["chat/after-tool"]] == ["user", "assistant", "tool"]
    assert job["chat/tool0"]["tools"] == TOOLS and job["chat/plain0"]["tools"] is None


# -- messages / conversations ----------------------------------------------------------------------------------
def test_messages_round_trip_through_the_chat_template(settings, job, tok, tok_dir, tmp_path) -> None:
    out = tmp_path / "messages.jsonl"
    result = export_job(settings, JOB, "messages", str(out), tokenizer=str(tok_dir))
    assert result.rows == len(job) and result.files == [str(out)] and not result.warnings
    for rec in _lines(out):
        want = job[rec["id"]]
        *source, reply = rec["messages"]
        # The source conversation, as given, and the stored ids under names no trainer mistakes for a
        # pre-tokenized row (prompt_ids, not input_ids).
        assert source == want["messages"] and rec.get("tools") == want["tools"]
        assert "input_ids" not in rec
        assert rec["prompt_ids"] == want["prompt"] and rec["output_ids"] == want["output"]
        assert list(reply) == [
            "role",
            "reasoning_content",
            "content",
            *(["tool_calls"] if "tool_calls" in reply else []),
        ]
        assert reply == {"role": "assistant", **want["reply"]}
        assert rec["finish_reason"] == want["finish"]

        # 1. The prompt part: rendering the source messages with the generation prompt gives the stored
        #    prompt ids exactly, for every row (plain, tools declared, after a tool result).
        assert render.render_ids(tok, source, rec.get("tools"), {"thinking": True}) == rec["prompt_ids"]

        # 2. The generated turn, rendered as the final assistant message: where the template keeps the
        #    final turn's reasoning (the turn has tool calls), the text is the stored ids' text exactly;
        #    where it does not (every turn without tool calls is "history"), the reasoning is blanked.
        if want["finish"] != "stop":
            continue
        full = tok.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=False, thinking=True)
        stored = tok.decode(rec["prompt_ids"] + rec["output_ids"], skip_special_tokens=False)
        if "tool_calls" in reply:
            assert full == stored
        else:
            assert reply["reasoning_content"] and reply["reasoning_content"] not in full
            prompt_text = tok.decode(rec["prompt_ids"], skip_special_tokens=False)
            history = [m["reasoning_content"] for m in source if m.get("reasoning_content")]
            if not history:
                assert full == prompt_text + "</think>" + reply["content"] + "<|im_end|>"
            else:
                # A plain final turn makes every earlier turn history too: reasoning the prompt had (an
                # earlier tool-calling turn's) is blanked as well, so even the prompt part changes.
                assert all(h in prompt_text and h not in full for h in history)
                assert not full.startswith(prompt_text)


def test_conversations_is_the_same_under_specforges_key(settings, job, tok_dir, tmp_path) -> None:
    messages = _lines(export_job(settings, JOB, "messages", str(tmp_path / "m.jsonl"), tokenizer=str(tok_dir)).path)
    path = export_job(settings, JOB, "conversations", str(tmp_path / "c.jsonl"), tokenizer=str(tok_dir)).path
    conversations = _lines(path)
    assert "messages" not in conversations[0]
    assert [{("messages" if k == "conversations" else k): v for k, v in r.items()} for r in conversations] == messages


def test_text_export_can_leave_the_reasoning_out(settings, job, tok_dir, tmp_path) -> None:
    path = export_job(
        settings, JOB, "messages", str(tmp_path / "m.jsonl"), tokenizer=str(tok_dir), exclude_reasoning=True
    )
    for rec in _lines(path.path):
        assert "reasoning_content" not in rec["messages"][-1]
        assert rec["messages"][-1]["content"] == job[rec["id"]]["reply"]["content"]


# -- hf ---------------------------------------------------------------------------------------------------------
def test_hf_dataset_loads_with_every_rows_ids_spans_and_metadata(settings, job, tmp_path) -> None:
    import datasets

    out = tmp_path / "hf"
    result = export_job(settings, JOB, "hf", str(out), shard_rows=4)
    assert result.rows == len(job)
    ds = datasets.load_from_disk(str(out))
    assert isinstance(ds, datasets.Dataset) and ds.num_rows == len(job)
    assert len(list(out.glob("data-*.arrow"))) == math.ceil(len(job) / 4)
    card = (out / "README.md").read_text()  # the data card (storage/card.py) travels with the dataset
    assert "Left out by this export's filters: nothing." in card and "### Prompts" in card and "GPU-hours" in card
    assert ds.features["input_ids"].feature.dtype == "int32"
    assert ds.features["tool_call_spans"].feature["start"].dtype == "int32"
    stored = {r["prompt_id"]: r for r in read_committed(settings.output_uri, JOB).to_pylist()}
    for rec in ds:
        row, want = stored[rec["id"]], job[rec["id"]]
        n = rec["prompt_len"]
        assert rec["input_ids"][:n] == want["prompt"] and rec["input_ids"][n:] == want["output"]
        assert rec["loss_mask"] == [0] * n + [1] * len(want["output"])
        assert rec["assistant_masks"] == rec["loss_mask"]  # the name TRL's SFTTrainer reads (test_consumers.py)
        for column in ("reasoning_start", "reasoning_end", "has_think_end", "answer_start", "answer_end"):
            assert rec[column] == row[column], column
        assert rec["tool_call_spans"] == row["tool_call_spans"]
        assert rec["finish_reason"] == want["finish"] and rec["dataset"] == "chat"
        assert rec["content_hash"] == row["content_hash"] and rec["model"] == row["model"]
        assert rec["created_at"] is not None

    # Exported again into the same directory with fewer shards: replaced whole.
    export_job(settings, JOB, "hf", str(out), drop_truncated=True)
    assert datasets.load_from_disk(str(out)).num_rows == len(job) - 1
    assert len(list(out.glob("data-*.arrow"))) == 1
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a saved dataset"):
        export_job(settings, JOB, "hf", str(tmp_path / "notes"))
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_push_to_hub_is_validated_first_and_goes_through_one_seam(settings, job, tmp_path, monkeypatch) -> None:
    calls: list[tuple[Any, str, dict[str, Any]]] = []
    monkeypatch.setattr(export_module, "push_dataset", lambda ds, repo, **kw: calls.append((ds, repo, kw)))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))  # no stored login either
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match="HF_TOKEN"):
        export_job(settings, JOB, "hf", str(out), push_to_hub="me/data")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(ExportError, match="not a Hub repo id"):
        export_job(settings, JOB, "hf", str(out), push_to_hub="me/da ta")
    with pytest.raises(ExportError, match="--format hf"):
        export_job(settings, JOB, "specforge", str(tmp_path / "s.jsonl"), push_to_hub="me/data")
    assert not out.exists() and not calls  # refused before anything was read or written

    args = [JOB, "--format", "hf", "--out", str(out), "--push-to-hub", "me/data", "--hub-private", "--json"]
    args += ["--output-uri", settings.output_uri, "--redis-url", settings.redis_url, "--shard-rows", "5"]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["pushed_to"] == "me/data"
    ((dataset, repo, kwargs),) = calls
    assert repo == "me/data" and kwargs == {"token": "hf_test", "private": True, "num_shards": 2}
    assert dataset.num_rows == len(job)


# -- specforge / eagle3 ------------------------------------------------------------------------------------------
def test_specforge_records_are_ids_and_an_equal_length_mask(settings, job, tmp_path) -> None:
    out = tmp_path / "sf.jsonl"
    result = export_job(settings, JOB, "specforge", str(out))
    records = _lines(out)
    assert result.rows == len(records) == len(job) and result.skipped == {}
    for rec in records:
        want = job[rec["id"]]
        assert set(rec) == {"id", "input_ids", "loss_mask"}
        assert rec["input_ids"] == want["prompt"] + want["output"]
        assert rec["loss_mask"] == [0] * len(want["prompt"]) + [1] * len(want["output"])
    assert result.longest == max(len(r["input_ids"]) for r in records) < SPECFORGE_MAX_LENGTH
    assert result.over_max_length == 0 and not result.warnings

    # Without the reasoning: the row truncated inside its reasoning has nothing left to train on.
    result = export_job(settings, JOB, "specforge", str(out), exclude_reasoning=True, max_length=60)
    records = _lines(out)
    assert result.skipped == {"no_trainable_tokens": 1} and len(records) == len(job) - 1
    for rec in records:
        want = job[rec["id"]]
        think_end = want["output"].index(kimi.THINK_END)
        assert rec["loss_mask"] == [0] * (len(want["prompt"]) + think_end + 1) + [1] * (
            len(want["output"]) - think_end - 1
        )
    over = sum(len(r["input_ids"]) > 60 for r in records)
    assert over and result.over_max_length == over
    assert any(f"{over} of {len(records)} rows are longer than 60 tokens" in w for w in result.warnings)
    assert any("no trainable token" in w for w in result.warnings)


def test_filters_drop_truncated_rows_and_thin_reasoning(settings, job, tmp_path) -> None:
    out = tmp_path / "e.jsonl"
    args = [JOB, "--format", "eagle3", "--out", str(out), "--drop-truncated", "--min-reasoning-tokens", "5"]
    args += ["--output-uri", settings.output_uri, "--redis-url", settings.redis_url]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    assert "left out 1 rows: truncated" in result.output and "left out 1 rows: short reasoning" in result.output
    ids = {r["id"] for r in _lines(out)}
    assert ids == set(job) - {"chat/plain4", "chat/plain5"}


def test_shards_locally_named_after_out_and_stale_shards_go(settings, job, tmp_path) -> None:
    whole = _lines(export_job(settings, JOB, "specforge", str(tmp_path / "all.jsonl")).path)
    out = tmp_path / "shards" / "sf.jsonl"
    result = export_job(settings, JOB, "specforge", str(out), shard_rows=2)
    names = [Path(f).name for f in result.files]
    assert names == [f"sf-{i:05d}.jsonl" for i in range(5)]
    assert [len(_lines(f)) for f in result.files] == [2, 2, 2, 2, 1]
    assert [r for f in result.files for r in _lines(f)] == whole
    (out.parent / "other.jsonl").write_text("{}\n")  # not ours: kept
    result = export_job(settings, JOB, "specforge", str(out), shard_rows=4)
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "other.jsonl",
        "sf-00000.jsonl",
        "sf-00001.jsonl",
        "sf-00002.jsonl",
        "sf.jsonl.provenance.json",  # the export's provenance sidecar (storage/exports/provenance.py)
    ]

    # A directory --out: part-NNNNN; eagle3 shards are Parquet there.
    result = export_job(settings, JOB, "eagle3", str(tmp_path / "e3"), shard_rows=5)
    assert [Path(f).name for f in result.files] == ["part-00000.parquet", "part-00001.parquet"]
    table = pq.read_table(str(tmp_path / "e3"))
    assert table.num_rows == len(job) and sorted(table["id"].to_pylist()) == sorted(job)
    with pytest.raises(ExportError, match="is a directory"):
        export_job(settings, JOB, "specforge", str(tmp_path / "e3"))


def _s3_keys(endpoint: str, prefix: str) -> list[str]:
    """Object keys under ``prefix`` (not the empty directory marker pyarrow leaves after a delete)."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in found if not o["Key"].endswith("/"))


def _s3_text(endpoint: str, key: str) -> str:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


def test_exports_to_s3(settings, job, tok_dir, tmp_path, s3_endpoint) -> None:  # noqa: F811
    settings = settings.with_overrides(s3_endpoint_url=s3_endpoint)
    local = _lines(export_job(settings, JOB, "specforge", str(tmp_path / "sf.jsonl")).path)
    result = export_job(settings, JOB, "specforge", f"s3://{BUCKET}/exports/sf.jsonl", shard_rows=4)
    keys = [f"exports/sf-{i:05d}.jsonl" for i in range(3)]
    sidecar = "exports/sf.jsonl.provenance.json"  # the export's provenance (storage/exports/provenance.py)
    assert result.files == [f"s3://{BUCKET}/{k}" for k in keys]
    assert _s3_keys(s3_endpoint, "exports/") == [*keys, sidecar]
    assert [json.loads(line) for k in keys for line in _s3_text(s3_endpoint, k).splitlines()] == local
    export_job(settings, JOB, "specforge", f"s3://{BUCKET}/exports/sf.jsonl", shard_rows=5)
    assert _s3_keys(s3_endpoint, "exports/") == [*keys[:2], sidecar]  # the stale third shard is gone

    export_job(settings, JOB, "messages", f"s3://{BUCKET}/m/all.jsonl", tokenizer=str(tok_dir))
    assert {json.loads(line)["id"] for line in _s3_text(s3_endpoint, "m/all.jsonl").splitlines()} == set(job)

    result = export_job(settings, JOB, "hf", f"s3://{BUCKET}/hf", shard_rows=5)
    keys = _s3_keys(s3_endpoint, "hf/")
    assert keys == [
        "hf/README.md",  # the dataset card and the export's provenance (storage/exports/provenance.py)
        "hf/_provenance.json",
        "hf/data-00000-of-00002.arrow",
        "hf/data-00001-of-00002.arrow",
        "hf/dataset_info.json",
        "hf/state.json",
    ]
    import datasets

    back = tmp_path / "hf-back"
    back.mkdir()
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for key in keys:
        client.download_file(BUCKET, key, str(back / Path(key).name))
    assert datasets.load_from_disk(str(back)).num_rows == len(job)


# -- the report extra ------------------------------------------------------------------------------------------
def test_report_charts_without_matplotlib_name_the_extra(settings, job, tmp_path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    args = [JOB, "--out", str(tmp_path / "rep"), "--output-uri", settings.output_uri, "--redis-url", settings.redis_url]
    result = CliRunner().invoke(report, args)
    assert result.exit_code == 1 and "pip install 'thinkfleet[report]'" in result.output
    result = CliRunner().invoke(report, [*args[:1], *args[3:], "--json"])  # the summary alone needs no charts
    assert result.exit_code == 0, result.output
