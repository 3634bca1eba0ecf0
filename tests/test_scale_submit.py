"""`producer submit` in bounded memory stays all or nothing: its prompt hashes are staged beside its messages and
merged by the commit's MULTI, its manifest rows spooled and written in files of bounded size."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from producer.collector import ManifestSpool
from producer.submit import submit
from producer.submit_options import SubmitError, SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.harness import isolated_settings
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return isolated_settings(redis_url, str(tmp_path / "out"))


def _tok() -> str:
    return str(build_test_tokenizer(default_test_tokenizer_dir()))


def test_a_failed_submit_leaves_no_prompt_hash_and_no_staging(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given a dataset whose last row is broken (no user message), submitted without --skip-invalid.
    rows = chat_rows(30, words=6)
    rows[-1] = {"id": "bad", "messages": []}
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(SubmitError):
        submit(settings, SubmitOptions(paths=[path], job="f", tokenizer=_tok(), processes=1))
    # Then nothing of it is in Redis: no queued message, no prompt hash, no staged key left to expire.
    k = settings.keys
    assert redis_client.llen(settings.queue) == 0
    assert not redis_client.exists(k.prompts("f"), k.prompt_dataset("f"))
    assert not list(redis_client.scan_iter(match=f"{settings.key_prefix}:job:f:staging:*"))


def test_a_second_submit_merges_its_staged_hashes_into_the_jobs(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = _tok()
    a = write_jsonl(tmp_path / "a.jsonl", chat_rows(40, words=6))
    b = write_jsonl(tmp_path / "b.jsonl", chat_rows(25, words=6, seed=2))
    monkeypatch.setattr(ManifestSpool, "CHUNK", 7)  # spool and manifest files of a few rows each
    monkeypatch.setattr(ManifestSpool, "FILE_ROWS", 16)
    submit(settings, SubmitOptions(paths=[a], job="m", tokenizer=tok, processes=2))
    # When a second dataset joins the job (the commit merges into existing hashes, not a RENAME).
    report = submit(settings, SubmitOptions(paths=[a, b], job="m", tokenizer=tok, processes=2))
    assert report.enqueued == 25
    k = settings.keys
    datasets = {v.decode() for v in redis_client.hvals(k.prompt_dataset("m"))}
    assert redis_client.hlen(k.prompts("m")) == 65 and datasets == {"a", "b"}
    assert {k: int(v) for k, v in redis_client.hgetall(k.dataset_counters("m", "b")).items()} == {b"submitted": 25}
    assert redis_client.llen(settings.queue) == 65
    assert not list(redis_client.scan_iter(match=f"{settings.key_prefix}:job:m:staging:*"))
    # And storage's manifest lists every prompt once (40 + 65 rows over several files, the latest submit wins).
    from storage.manifest import read_submitted

    manifest = read_submitted(settings.output_uri, "m")
    assert manifest.num_rows == 65 and len(set(manifest.column("prompt_id").to_pylist())) == 65
    files = list(Path(settings.output_uri).rglob("submitted-*.parquet"))
    assert len(files) == 2 + 4  # whole spool chunks of 7 until a file holds ≥ 16: 40 = 21 + 19, 65 = 3 × 21 + 2
