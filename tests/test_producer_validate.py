"""`producer submit` checks every rendered prompt against the model before it reaches a GPU: every id below the
vocabulary size (an id beyond it is a CUDA device-side assert, and a reload of the model takes up to an hour),
prompt + max_new_tokens below the context length (otherwise SGLang answers 400 only once a worker sends it)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from click.testing import CliRunner

from producer import render
from producer.cli import cli
from producer.submit import submit
from producer.submit_options import SubmitError, SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord

#: Generation budget used throughout; the long row leaves room for exactly ROOM new tokens.
BUDGET = 100
ROOM = 39


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


def rows() -> list[dict[str, Any]]:
    """Five short rows; the third (alpha.jsonl:3) is long."""
    out = chat_rows(5, words=10)
    out[2]["messages"][1]["content"] = "word " * 250
    return out


@pytest.fixture(scope="module")
def long_tokens(tok_dir: Path) -> int:
    tok = render.load_tokenizer(str(tok_dir))
    lengths = [len(render.render_ids(tok, r["messages"][:2], None, {"thinking": True})) for r in rows()]
    assert max(lengths[:2] + lengths[3:]) + BUDGET < lengths[2]  # the short rows fit whatever happens to the long one
    return lengths[2]


def model_dir(base: Path, tok_dir: Path, config: dict[str, Any]) -> Path:
    """A model directory: the test tokenizer plus a config.json."""
    target = base / "model"
    shutil.copytree(tok_dir, target)
    (target / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], **config}))
    return target


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tok_dir: Path, long_tokens: int) -> Path:
    """Context = the long prompt + ROOM + 1: it fits with max_new_tokens ROOM, not with BUDGET."""
    config = {"vocab_size": kimi.VOCAB_SIZE, "max_position_embeddings": long_tokens + ROOM + 1}
    return model_dir(tmp_path_factory.mktemp("ctx"), tok_dir, config)


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))


def opts(path: Path, tokenizer: Path, **kw: Any) -> SubmitOptions:
    return SubmitOptions(
        paths=[path],
        job="j",
        tokenizer=str(tokenizer),
        processes=1,
        sampling={"max_new_tokens": kw.pop("max_new_tokens", BUDGET)},
        **kw,
    )


def queued_ids(client: redis.Redis, settings: Settings) -> list[str]:
    out = []
    for raw in reversed(client.lrange(settings.queue, 0, -1)):
        args = msgpack.unpackb(base64.b64decode(json.loads(raw)["body"]), raw=False)[0]
        out.append(PromptTask.from_args(args).prompt_id)
    return out


def nothing_enqueued(client: redis.Redis, settings: Settings) -> bool:
    return (
        client.llen(settings.queue) == 0
        and not client.keys("tf:job:*:staging:*")
        and JobRecord.load(client, settings.keys, "j") is None
    )


# -- context length ----------------------------------------------------------------------------------------
def test_a_row_over_the_context_is_refused_naming_file_row_and_the_fix(
    settings, redis_client, model, long_tokens, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    context = long_tokens + ROOM + 1
    with pytest.raises(SubmitError) as err:
        submit(settings, opts(path, model))
    text = str(err.value)
    assert "1 problem(s); nothing was enqueued" in text
    assert (
        f"alpha.jsonl:3: prompt is {long_tokens:,} tokens + max_new_tokens {BUDGET} ≥ context {context:,} "
        "(config.json max_position_embeddings; SGLang needs prompt + max_new_tokens < context): "
        f"lower --max-new-tokens to {ROOM} or drop the row"
    ) in text
    assert "--skip-invalid" in text
    assert nothing_enqueued(redis_client, settings)
    # The fix the message names works: prompt + ROOM = context - 1 fits.
    assert submit(settings, opts(path, model, max_new_tokens=ROOM)).enqueued == 5


def test_skip_invalid_enqueues_the_rest_and_records_the_skip(
    settings, redis_client, model, long_tokens, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    report = submit(settings, opts(path, model, skip_invalid=True))
    assert report.enqueued == 4
    assert queued_ids(redis_client, settings) == ["alpha/r0", "alpha/r1", "alpha/r3", "alpha/r4"]
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert record.skipped_count == 1 and record.prompts == 4
    assert record.skipped[0]["location"].endswith("alpha.jsonl:3")
    assert f"lower --max-new-tokens to {ROOM}" in record.skipped[0]["reason"]
    # What workers read to refuse the same things.
    assert (record.vocab_size, record.vocab_source) == (kimi.VOCAB_SIZE, "config.json vocab_size")
    assert (record.context_length, record.context_source) == (
        long_tokens + ROOM + 1,
        "config.json max_position_embeddings",
    )
    assert not any("context length unknown" in w for w in report.warnings)


def test_samples_are_checked_once_per_row(settings, redis_client, model, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    report = submit(settings, opts(path, model, skip_invalid=True, samples=2))
    assert report.enqueued == 8
    assert JobRecord.load(redis_client, settings.keys, "j").skipped_count == 1


def test_context_length_flag_overrides_the_config(settings, redis_client, model, long_tokens, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    # Larger than config.json: the long row fits.
    report = submit(settings, opts(path, model, context_length=long_tokens + BUDGET + 1, dry_run=True))
    assert report.enqueued == 5 and not report.problems
    # Smaller (a server started with a lower --context-length): a short row no longer fits either.
    with pytest.raises(SubmitError, match=r"alpha\.jsonl:1: prompt is \d+ tokens \+ max_new_tokens 100 ≥ context 120 "):
        submit(settings, opts(path, model, context_length=120))
    assert nothing_enqueued(redis_client, settings)
    submit(settings, opts(path, model, context_length=long_tokens + BUDGET + 1))
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert (record.context_length, record.context_source) == (long_tokens + BUDGET + 1, "--context-length")


def test_a_resubmit_without_the_flag_keeps_the_jobs_context_length(
    settings, redis_client, tok_dir, long_tokens, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    context = long_tokens + BUDGET + 1
    submit(settings, opts(path, tok_dir, context_length=context))  # no config.json: the flag is all there is
    rows_now = rows()
    rows_now.append({"id": "late", "messages": [{"role": "user", "content": "word " * 300}]})
    write_jsonl(path, rows_now)
    inherited = rf"alpha\.jsonl:6: .* context {context:,} \(--context-length, as first submitted"
    with pytest.raises(SubmitError, match=inherited):
        submit(settings, opts(path, tok_dir))
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert (record.context_length, record.context_source) == (context, "--context-length")


def test_a_prompt_that_leaves_no_room_names_no_budget(settings, model, long_tokens, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    with pytest.raises(SubmitError) as err:
        submit(settings, opts(path, model, context_length=long_tokens + 1, max_new_tokens=1))
    text = str(err.value)
    assert f"alpha.jsonl:3: prompt is {long_tokens:,} tokens, leaving no room for one new token in context" in text
    assert "lower --max-new-tokens" not in text


def test_the_cli_flag_reaches_the_check_and_the_job_record(redis_url, redis_client, model, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    base = ["submit", str(path), "--job", "c", "--tokenizer", str(model), "--redis-url", redis_url,
            "--output-uri", str(tmp_path / "out"), "--processes", "1", "--max-new-tokens", str(BUDGET)]  # fmt: skip
    result = CliRunner().invoke(cli, [*base, "--context-length", "120"])
    assert result.exit_code == 1
    assert "alpha.jsonl:1: prompt is" in result.stderr and "≥ context 120 (--context-length" in result.stderr
    assert redis_client.dbsize() == 0
    result = CliRunner().invoke(cli, [*base, "--context-length", "100000", "--json"])
    assert result.exit_code == 0, result.stderr
    record = JobRecord.load(redis_client, Keys(), "c")
    assert (record.context_length, record.context_source) == (100_000, "--context-length")


# -- vocabulary ------------------------------------------------------------------------------------------------
def test_an_id_beyond_the_models_vocabulary_is_refused_naming_file_row(
    settings, redis_client, tok_dir, tmp_path
) -> None:
    """Nothing pre-tokenized enters the producer, so an out-of-range id comes from the tokenizer: here the model's
    embedding (config.json vocab_size) ends after Kimi's used specials while the tokenizer has reserved tokens
    beyond it, and a row's text spells one of them."""
    vocab = kimi.THINK_END + 1
    model = model_dir(tmp_path, tok_dir, {"vocab_size": vocab, "max_position_embeddings": 262_144})
    data = chat_rows(3, words=10)
    data[1]["messages"][1]["content"] = "tell me about <|reserved_token_163700|> please"
    path = write_jsonl(tmp_path / "alpha.jsonl", data)
    with pytest.raises(SubmitError) as err:
        submit(settings, opts(path, model))
    text = str(err.value)
    assert "1 problem(s); nothing was enqueued" in text
    at = render.render_ids(render.load_tokenizer(str(model)), data[1]["messages"][:2], None, {"thinking": True})
    assert f"alpha.jsonl:2: id 163,700 '<|reserved_token_163700|>' at position {at.index(163_700)} ≥" in text
    assert f"≥ vocabulary size {vocab:,} (config.json vocab_size): the model has no embedding for it" in text
    assert nothing_enqueued(redis_client, settings)
    report = submit(settings, opts(path, model, skip_invalid=True))
    assert report.enqueued == 2
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert record.skipped[0]["location"].endswith("alpha.jsonl:2") and "163,700" in record.skipped[0]["reason"]
    assert (record.vocab_size, record.vocab_source) == (vocab, "config.json vocab_size")


def test_without_config_json_the_tokenizer_length_bounds_ids_and_one_warning_says_context_is_unchecked(
    settings, redis_client, tok_dir, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", rows())
    report = submit(settings, opts(path, tok_dir, max_new_tokens=1_000_000))  # nothing to check it against
    assert report.enqueued == 5
    assert [w for w in report.warnings if "context length unknown" in w] == [report.warnings[-1]]
    assert "--context-length" in report.warnings[-1]
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert (record.vocab_size, record.vocab_source) == (kimi.VOCAB_SIZE, "len(tokenizer)")
    assert (record.context_length, record.context_source) == (None, "")


# -- the check itself -------------------------------------------------------------------------------------------
def test_check_prompt_bounds() -> None:
    limits = render.ModelLimits(1000, "config.json vocab_size", 500, "config.json max_position_embeddings")
    assert render.check_prompt(400, 999, 99, limits) is None  # 499 < 500
    assert "lower --max-new-tokens to 99 or drop the row" in render.check_prompt(400, 999, 100, limits)
    assert "no room for one new token" in render.check_prompt(499, 999, 1, limits)
    assert "no room for one new token" in render.check_prompt(600, 999, 1, limits)
    reason = render.check_prompt(4, 1000, 1, limits, ids=[5, 1000, 7, 1200])
    assert reason.startswith("id 1,000 at position 1 (2 such ids) ≥ vocabulary size 1,000 (config.json vocab_size)")
    # Ids are checked first (a crash beats a 400), and with no context length only ids are checked.
    assert render.check_prompt(600, 1000, 1, limits).startswith("id 1,000 ≥ vocabulary size")
    assert render.check_prompt(10**6, 999, 10**6, render.ModelLimits(1000, "len(tokenizer)")) is None


def test_model_limits_read_kimi_k25_and_deepseek_v3_configs(tok_dir, tmp_path) -> None:
    tok = render.load_tokenizer(str(tok_dir))
    yarn = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}

    def limits(config: dict[str, Any], name: str, **kw: Any) -> render.ModelLimits:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return render.model_limits(tok, str(d), **kw)

    # Kimi-K2.5: a multimodal wrapper whose language model (a DeepSeek-V3 config) sits in text_config.
    k25 = limits(
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": {"vocab_size": 163_840, "max_position_embeddings": 262_144, "rope_scaling": yarn},
            "vision_config": {"patch_size": 14},
        },
        "k25",
    )
    assert k25 == render.ModelLimits(
        163_840, "config.json text_config.vocab_size", 262_144, "config.json text_config.max_position_embeddings"
    )
    # DeepSeek-V3 / Kimi-K2: top level; YaRN's max_position_embeddings is already the extended length.
    v3 = limits({"vocab_size": 129_280, "max_position_embeddings": 163_840, "rope_scaling": yarn}, "v3")
    assert (v3.vocab_size, v3.context_length) == (129_280, 163_840)
    # A linear rope factor without an original length multiplies, as SGLang's get_context_length does.
    linear = limits({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4}}, "linear")
    assert linear.context_length == 16_384 and "× rope_scaling.factor 4" in linear.context_source
    assert linear.vocab_source == "len(tokenizer)"
    # The flag wins; a config without any length key leaves the context unknown (SGLang would guess 2048).
    assert limits({"vocab_size": 10}, "flag", context_length=999) == render.ModelLimits(
        10, "config.json vocab_size", 999, "--context-length"
    )
    unknown = limits({"hidden_size": 8}, "unknown")
    assert unknown.context_length is None and unknown.context_warning() is not None


def test_an_old_job_record_without_the_fields_reads_as_unknown() -> None:
    record = JobRecord.from_hash({b"name": b'"old"', b"prompts": b"3"})
    assert (record.vocab_size, record.vocab_source) == (None, "")
    assert (record.context_length, record.context_source) == (None, "")
    again = JobRecord.from_hash(JobRecord(name="n", vocab_size=5, context_length=7, context_source="x").to_hash())
    assert (again.vocab_size, again.context_length, again.context_source) == (5, 7, "x")
