"""Redis is not trusted with code: whoever can write Redis (a producer, Flower or admin password, a Redis exposed by
mistake) plus a directory a worker can read must not be able to make a worker run anything it did not choose.

- **signing** (thinkfleet/signing.py): with a key, every message and job record must carry the producer's HMAC;
  an unsigned message, one re-signed with another key or changed after signing is refused into the malformed
  list (never into the job: a forged copy cannot take a real prompt out of the queue's reach), a forged or
  changed job record dead-letters its messages whole (``unsigned_job`` / ``bad_job_signature``);
- **code** (workers/jobs.py): a ``--turns all`` job's tokenizer runs its own code only where the *worker* allows it
  (``remote_code_refused``) and loads only from the worker's roots (``tokenizer_refused``), symlinks resolved;
- **paths** (storage/layout.py ``confine_part``): a claim's ``part`` from Redis is used only when it is a part of
  the prompt's own job and dataset, resolved; compaction never follows a name out of its directory;
- **hashes**: a message's ``content_hash`` is mandatory and checked (``bad_content_hash``).

Each ends in a refusal with nothing lost: the genuine prompts beside the forged ones are stored byte for byte,
and a refused job's prompts are in its dead letters, whole, stored once ``producer retry`` resends them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import msgpack
import pyarrow.parquet as pq
import pytest
import redis

from storage import layout
from storage.compact import compact_job
from storage.writer import PartWriter
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import (
    fast_env,
    isolated_settings,
    make_prompts,
    metric_counter,
    producer_cli,
    register_ids,
    simulator,
    worker_metrics,
)
from testing.record import check_job
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.celery_app import send_tasks
from thinkfleet.keys import Keys
from thinkfleet.message import TASK_NAME, MessageRefused, PromptTask, content_hash, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.signing import SIGNATURE_FIELD, Signer, SigningKeyError, signer_for
from thinkfleet.state.job import JobRecord
from workers.app import make_app
from workers.jobs import JobSpec, check_job_hash, confined_tokenizer, tokenizer_refusal, tokenizer_roots

KEY = b"k" * 40
OTHER_KEY = b"o" * 40


def _task(**kw: object) -> PromptTask:
    ids = [5, 6, 7]
    values: dict[str, object] = {
        "job": "job",
        "dataset": "ds",
        "prompt_id": "p",
        "row_index": 3,
        "content_hash": content_hash(ids),
        "ids_blob": pack_ids(ids),
        "sample_index": 1,
        "revision": 2,
        "overrides": {"max_new_tokens": 99},
        "generation": "g1",
    }
    values.update(kw)
    return PromptTask(**values)  # type: ignore[arg-type]


def _refusal(signer: Signer, task: PromptTask) -> str:
    with pytest.raises(MessageRefused) as info:
        signer.check_task(task)
    return info.value.error_class


# -- messages ---------------------------------------------------------------------------------------------------
def test_a_signature_binds_job_prompt_hash_sampling_and_revision_and_nothing_else_passes() -> None:
    signer = Signer(KEY)
    signed = signer.sign_task(_task())
    signer.check_task(signed)
    assert signed.signature.startswith("v1:") and len(signed.signature) == 3 + 64
    # Every field a worker acts on is bound: change any one after signing and the signature fails.
    changes = {
        "job": "job2",
        "dataset": "ds2",
        "prompt_id": "q",
        "row_index": 4,
        "content_hash": content_hash([5, 6, 8]),
        "sample_index": 0,
        "revision": 3,
        "overrides": {"max_new_tokens": 100},
        "generation": "g2",
    }
    for name, value in changes.items():
        assert _refusal(signer, dataclasses.replace(signed, **{name: value})) == "bad_signature", name
    assert _refusal(signer, dataclasses.replace(signed, overrides={})) == "bad_signature"
    # Unsigned, re-signed by someone else, or a signature of another shape.
    assert _refusal(signer, _task()) == "unsigned_message"
    assert _refusal(signer, Signer(OTHER_KEY).sign_task(_task())) == "bad_signature"
    for forged in ("v1:" + "0" * 64, "v2:" + signed.signature[3:], signed.signature[:-1], "x"):
        assert _refusal(signer, dataclasses.replace(signed, signature=forged)) == "bad_signature", forged
    # A retired key is still accepted while work signed with it drains; it never signs.
    rotated = Signer(OTHER_KEY, accepted=[KEY])
    rotated.check_task(signed)
    assert rotated.sign_task(_task()).signature != signed.signature
    with pytest.raises(SigningKeyError):
        Signer(b"short")


def test_the_signature_rides_as_an_eleventh_arg_and_older_bodies_still_decode() -> None:
    signer = Signer(KEY)
    signed = signer.sign_task(_task())
    args = signed.to_args()
    assert len(args) == 11 and args[10] == signed.signature
    assert PromptTask.from_args(msgpack.unpackb(msgpack.packb(args, use_bin_type=True))) == signed
    # A signed task of a job before generations still carries 11 args ('' generation).
    no_gen = signer.sign_task(_task(generation=""))
    assert len(no_gen.to_args()) == 11 and PromptTask.from_args(no_gen.to_args()) == no_gen
    # The current producer's format without a key, and an older producer's, decode as before (no signature).
    assert len(_task().to_args()) == 10 and PromptTask.from_args(_task().to_args()).signature == ""
    nine = _task(generation="").to_args()
    assert len(nine) == 9 and PromptTask.from_args(nine) == _task(generation="")
    with pytest.raises(ValueError, match="signature"):
        PromptTask.from_args([*_task().to_args(), 7])
    # What follows the signature is typed (12th: the reusable prefix, 13th: the images), and nothing after that.
    with pytest.raises(ValueError, match="prefix_reusable must be a token count"):
        PromptTask.from_args([*signed.to_args(), "extra"])
    with pytest.raises(ValueError, match="11 with its signature"):
        PromptTask.from_args([*signed.to_args(), None, [], "extra"])


def test_the_envelope_and_send_tasks_sign_with_the_settings_key(tmp_path: Path) -> None:
    from thinkfleet.broker.envelope import Envelope

    key_file = tmp_path / "signing_key"
    key_file.write_text(KEY.decode() + "\n")
    settings = Settings(signing_key_file=str(key_file))
    signer = signer_for(settings)
    assert signer is not None
    raw = json.loads(Envelope(settings).encode(_task()))
    import base64

    args = msgpack.unpackb(base64.b64decode(raw["body"]), raw=False)[0]
    signer.check_task(PromptTask.from_args(args))
    # A task that is signed already (a paused job's message, a dead letter resent) keeps its signature.
    foreign = Signer(OTHER_KEY).sign_task(_task())
    kept = msgpack.unpackb(base64.b64decode(json.loads(Envelope(settings).encode(foreign))["body"]), raw=False)[0]
    assert kept[10] == foreign.signature
    # No key: nothing signed (the format of a fleet without one).
    plain = msgpack.unpackb(base64.b64decode(json.loads(Envelope(Settings()).encode(_task()))["body"]), raw=False)[0]
    assert len(plain) == 10
    # A key file that is short or missing is named, never silently ignored.
    key_file.write_text("short\n")
    with pytest.raises(SigningKeyError, match="at least 32"):
        signer_for(Settings(signing_key_file=str(key_file)))
    with pytest.raises(SigningKeyError, match="cannot read"):
        signer_for(Settings(signing_key_file=str(tmp_path / "nope")))


# -- job records ------------------------------------------------------------------------------------------------
def test_a_job_record_is_signed_whole_and_a_forged_or_changed_one_is_refused(redis_client: redis.Redis) -> None:
    keys = Keys("sig")
    signer = Signer(KEY)
    record = JobRecord(name="job", tokenizer="/models/k", sampling_params={"temperature": 1.0}, generation="g1")
    record.save(redis_client, keys, signer)
    raw = redis_client.hgetall(keys.job("job"))
    assert SIGNATURE_FIELD.encode() in raw
    loaded, turns = check_job_hash("job", raw, signer)
    assert loaded.tokenizer == "/models/k" and turns == {}

    def refused(raw: dict, job: str = "job") -> str:
        with pytest.raises(MessageRefused) as info:
            check_job_hash(job, raw, signer)
        return info.value.error_class

    # A field changed, added or removed after signing; the record copied onto another job's key.
    assert refused({**raw, b"sampling_params": json.dumps({"temperature": 0.0}).encode()}) == "bad_job_signature"
    assert refused({**raw, b"tokenizer": b'"/tmp/evil"'}) == "bad_job_signature"
    assert refused({**raw, b"expected_model": b'"other"'}) == "bad_job_signature"
    assert refused({k: v for k, v in raw.items() if k != b"vocab_size"}) == "bad_job_signature"
    assert refused(raw, job="other") == "bad_job_signature"
    # Unsigned (a record written by anything without the key), or signed by another key.
    assert refused({k: v for k, v in raw.items() if k != SIGNATURE_FIELD.encode()}) == "unsigned_job"
    other = Signer(OTHER_KEY).sign_record_hash("job", record.to_hash())
    assert refused({k.encode(): v.encode() for k, v in other.items()}) == "bad_job_signature"
    # The turns field (--turns all) is signed on its own: its trust_remote_code cannot be switched on.
    turns = signer.sign_doc("turns", "job", "", {"mode": "all", "trust_remote_code": False})
    _, meta = check_job_hash("job", {**raw, b"turns": json.dumps(turns).encode()}, signer)
    assert meta["mode"] == "all"
    forged = {**turns, "trust_remote_code": True}
    assert refused({**raw, b"turns": json.dumps(forged).encode()}) == "bad_job_signature"
    assert refused({**raw, b"turns": json.dumps({"mode": "all"}).encode()}) == "bad_job_signature"
    # Without a key nothing is checked (a fleet before signing), and a record saved without one has no signature.
    assert check_job_hash("job", {**raw, b"tokenizer": b'"/x"'}, None)[0].tokenizer == "/x"
    record.save(redis_client, keys)
    assert SIGNATURE_FIELD.encode() not in redis_client.hgetall(keys.job("job"))


# -- the tokenizer a worker loads ---------------------------------------------------------------------------------
def _spec(tokenizer: str, remote_code: bool = False, multi_turn: bool = True) -> JobSpec:
    return JobSpec("job", {}, "", "", None, multi_turn=multi_turn, tokenizer=tokenizer, remote_code=remote_code)


def test_remote_code_and_the_tokenizer_path_are_the_workers_choice(tmp_path: Path) -> None:
    model = tmp_path / "models" / "kimi"
    (model / "sub").mkdir(parents=True)
    outside = tmp_path / "shared-output" / "evil-tokenizer"
    outside.mkdir(parents=True)
    (model / "link-out").symlink_to(outside)
    roots = tokenizer_roots("", str(model))  # default: the model directory the node serves
    assert roots == [os.path.realpath(model)]
    assert tokenizer_refusal(_spec(str(model)), False, roots) is None
    assert tokenizer_refusal(_spec(str(model / "sub")), False, roots) is None
    # A job asking for remote code on a worker that does not allow it.
    refusal = tokenizer_refusal(_spec(str(model), remote_code=True), False, roots)
    assert refusal is not None and refusal.error_class == "remote_code_refused"
    assert "THINKFLEET_TRUST_REMOTE_CODE" in refusal.detail
    assert tokenizer_refusal(_spec(str(model), remote_code=True), True, roots) is None
    # Paths outside the roots: plain, through '..', through a symlink, a sibling with the root as a prefix,
    # a relative path and a hub id (a cache anyone may write).
    for path in (
        str(outside),
        f"{model}/../../shared-output/evil-tokenizer",
        str(model / "link-out"),
        f"{model}-evil",
        "models/kimi",
        "moonshotai/Kimi-K2.5",
        "",
    ):
        refusal = tokenizer_refusal(_spec(path), True, roots)
        assert refusal is not None and refusal.error_class == "tokenizer_refused", path
    assert confined_tokenizer(f"{model}/sub/../sub", roots) == os.path.realpath(model / "sub")
    # Configured roots replace the default; a job that is not --turns all loads no tokenizer at all.
    configured = tokenizer_roots(f"{outside}{os.pathsep}{tmp_path / 'other'}", str(model))
    assert tokenizer_refusal(_spec(str(outside)), False, configured) is None
    assert tokenizer_refusal(_spec(str(model)), False, configured).error_class == "tokenizer_refused"  # type: ignore[union-attr]
    assert tokenizer_refusal(_spec("/anything", remote_code=True, multi_turn=False), False, []) is None
    # A served model that is a hub id (the simulator's) is no root.
    assert tokenizer_roots("", "moonshotai/Kimi-K2.5") == []


# -- part paths from Redis ---------------------------------------------------------------------------------------
def test_a_claims_part_path_must_be_a_part_of_the_prompts_own_job_and_dataset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    loc = layout.locate(str(out))
    writer = PartWriter(str(out), "w1")
    good = writer.part_name("job", "ds")
    assert layout.confine_part(loc, "job", good, "ds") == good
    assert layout.confine_part(loc, "job", good) == good
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "job").mkdir(parents=True)
    (out / "job" / "dataset=linked").symlink_to(elsewhere)
    (out / "job" / "dataset=ds").mkdir()
    (out / "job" / "dataset=ds" / "part-20250101T000000000000Z-w1-000009.parquet").symlink_to(elsewhere / "x.parquet")
    refused = [
        str(elsewhere / "part-1.parquet"),  # outside the output root
        "/etc/passwd",
        f"{out}/job/dataset=ds/../../other/dataset=ds/part-1.parquet",  # '..'
        f"{out}/job/dataset=ds//part-1.parquet",
        f"{out}/other/dataset=ds/part-1.parquet",  # another job
        f"{out}/job/dataset=ds/notes.txt",  # not a part
        f"{out}/job/_manifest/part-1.parquet",  # not a dataset directory
        f"{out}/job/dataset=ds/sub/part-1.parquet",
        f"{out}/job/dataset=linked/part-1.parquet",  # a dataset directory that links out
        f"{out}/job/dataset=ds/part-20250101T000000000000Z-w1-000009.parquet",  # a part that links out
        "relative/job/dataset=ds/part-1.parquet",
        f"file://{out}/job/dataset=ds/part-1.parquet",
        "",
        None,
        7,
    ]
    for path in refused:
        with pytest.raises(layout.PartPathRefused):
            layout.confine_part(loc, "job", path, None if path and "linked" in str(path) else "ds")
    with pytest.raises(layout.PartPathRefused):  # another dataset of the same job
        layout.confine_part(loc, "job", writer.part_name("job", "other"), "ds")
    # s3:// keys are checked by prefix (and normal form).
    s3 = layout.Location(loc.fs, "bucket/prefix", "s3")
    assert layout.confine_part(s3, "job", "s3://bucket/prefix/job/dataset=ds/part-1.parquet", "ds")
    for key in (
        "s3://bucket/prefix/job/dataset=ds/../../x/dataset=ds/part-1.parquet",
        "s3://bucket/prefix-other/job/dataset=ds/part-1.parquet",
        "s3://other/prefix/job/dataset=ds/part-1.parquet",
        "/bucket/prefix/job/dataset=ds/part-1.parquet",
        "s3://bucket/prefix/jobx/dataset=ds/part-1.parquet",
    ):
        with pytest.raises(layout.PartPathRefused):
            layout.confine_part(s3, "job", key, "ds")


def test_compaction_never_reads_or_deletes_a_path_outside_its_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    settings = Settings(output_uri=str(out))
    writer = PartWriter(str(out), "w1")
    rows = [make_row(f"p{i}", job="job", dataset="ds", content_hash=content_hash([i])) for i in range(4)]
    writer.write("job", "ds", rows[:2])
    writer.write("job", "ds", rows[2:])
    # A victim outside the job, and a compacted part planted in the dataset directory that claims to replace it.
    victim = tmp_path / "victim" / "part-20250101T000000000000Z-v-000000.parquet"
    victim.parent.mkdir()
    victim.write_bytes(b"not yours")
    planted = PartWriter(str(out), layout.COMPACT_TAG)
    name = os.path.relpath(victim, out / "job" / "dataset=ds")
    planted.write("job", "ds", [], layout.compacted_part_path(layout.locate(str(out)), "job", "ds", 7),
                  metadata={layout.COMPACTED_FROM_KEY: json.dumps([name]).encode()})  # fmt: skip
    # And a part that is a symlink to a Parquet file outside the job (another job's rows).
    foreign = tmp_path / "foreign.parquet"
    written = PartWriter(str(tmp_path / "other"), "w9").write(
        "job", "ds", [make_row("stolen", job="job", dataset="ds")]
    )
    os.replace(written, foreign)
    link = out / "job" / "dataset=ds" / "part-20250101T000000000000Z-w9-000000.parquet"
    link.symlink_to(foreign)
    result = compact_job(settings, "job")
    (report,) = result.datasets
    assert report.refused == [str(link)]
    assert victim.read_bytes() == b"not yours", "a name with '..' in a compacted part's list is never deleted"
    assert foreign.exists(), "a symlinked part's target is never read into the job nor deleted"
    committed = {r["prompt_id"] for r in pq.read_table(report.files_written[0]).to_pylist()}
    assert committed == {"p0", "p1", "p2", "p3"}, "the stolen row was not compacted into the job"


# -- end to end ---------------------------------------------------------------------------------------------------
def _send_raw(settings: Settings, args: list[object], task_id: str) -> None:
    """Publish args exactly as given (no signing: what a Redis writer without the key can push)."""
    app = make_app(settings, register=False)
    with app.producer_or_acquire() as producer:
        app.send_task(TASK_NAME, args=args, task_id=task_id, producer=producer, queue=settings.queue)


def test_forged_work_is_refused_with_a_reason_and_the_genuine_job_is_stored_exactly(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a fleet with a signing key: a producer-signed job of 10 prompts, and beside it what a Redis writer
    # without the key can do: messages unsigned, re-signed with their own key, or changed after signing; a signed
    # message with a hash that is no hash; a job whose record was written without the key, one whose signed
    # record was changed afterwards; and a claim whose part points at a Parquet file outside the job.
    key_file = tmp_path / "signing_key"
    key_file.write_text("s" * 64 + "\n")
    settings = isolated_settings(redis_url, str(tmp_path / "out"), signing_key_file=str(key_file))
    signer = signer_for(settings)
    assert signer is not None
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(10)
    job, tasks = register_ids(settings, "genuine", prompts)  # the record signed (register_ids signs with the key)
    keyless = Settings(**{**settings.model_dump(), "signing_key_file": None})
    _, forged_tasks = register_ids(keyless, "forgedrec", make_prompts(2, seed=2))  # the record unsigned
    changed_job, changed_tasks = register_ids(settings, "changedrec", make_prompts(2, seed=3))
    client.hset(keys.job("changedrec"), "sampling_params", json.dumps({**changed_job.sampling_params, "top_k": 1}))
    by_pid = {t.prompt_id: t for t in tasks}
    p0, p1, p2 = (by_pid[f"p{i:05d}"] for i in range(3))
    # A planted row for p2 outside the job, which a stale claim in Redis names as its committed part.
    planted = PartWriter(str(tmp_path / "planted"), "evil").write(
        "genuine", "synthetic", [make_row(p2.prompt_id, job="genuine", dataset="synthetic", output_ids=[1, 2, 3])]
    )
    client.hset(keys.claims("genuine"), p2.prompt_id,
                json.dumps({"worker": "ghost", "since": time.time() - 999, "part": planted, "epoch": 1}))  # fmt: skip
    forged = {
        # p0 again with another budget and no signature; p1 re-signed with the attacker's key; p0 signed, then
        # changed (its sampling) — each would change what a real prompt generates.
        "unsigned": (dataclasses.replace(p0, overrides={"max_new_tokens": 1}).to_args(), "unsigned_message"),
        "resigned": (Signer(b"a" * 40).sign_task(dataclasses.replace(p1, revision=5)).to_args(), "bad_signature"),
        "changed": (
            dataclasses.replace(signer.sign_task(p0), overrides={"max_new_tokens": 1}).to_args(),
            "bad_signature",
        ),
        # The current producer's 10-arg format and an older 9-arg body, unsigned: refused under a key.
        "old-10": (dataclasses.replace(p0, generation="x").to_args()[:10], "unsigned_message"),
        "old-9": (p0.to_args()[:9], "unsigned_message"),
    }
    hashless = dataclasses.replace(by_pid["p00009"], content_hash="h-p00009")
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "1000") as sim:
        env = fast_env(settings, sim, signing_key_file=str(key_file))
        worker = WorkerProcess("w1", env, tmp_path)
        for task_id, (args, _) in forged.items():
            _send_raw(settings, args, task_id)
        send_tasks(settings, [hashless, *forged_tasks, *changed_tasks])  # signed with the key
        send_tasks(settings, [t for t in tasks if t.prompt_id != "p00009"])
        worker.start()
        try:
            worker.wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, "genuine")["done"] == 9, 120, what="9 genuine rows")
            wait_until(lambda: job_progress(client, keys, "genuine")["dead"] == 1, 60, what="the hashless letter")
            wait_until(lambda: client.llen(keys.malformed) == len(forged), 60, what="the forged messages refused")
            wait_until(lambda: job_progress(client, keys, "forgedrec")["dead"] == 2, 60, what="unsigned record")
            wait_until(lambda: job_progress(client, keys, "changedrec")["dead"] == 2, 60, what="changed record")
            metrics = worker_metrics(client, keys, "w1")
        finally:
            worker.terminate()
    log = worker.log_path.read_text(errors="replace")
    # Then each forged message is refused, with its reason, in the malformed list — not in the job …
    malformed = [json.loads(m) for m in client.lrange(keys.malformed, 0, -1)]
    assert sorted(m["error"].split(":")[0] for m in malformed) == sorted(error for _, error in forged.values())
    assert {m["message_id"] for m in malformed} == {"genuine/p00000/r0", "genuine/p00001/r5"}
    assert all(m["args"] for m in malformed), "the refused message's args are kept"
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "unsigned_message") == 3
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "bad_signature") == 2
    # … the forged and the changed records dead-letter their (genuinely signed) messages, whole …
    assert {d["error_class"] for d in dead_letters(client, keys, "forgedrec").values()} == {"unsigned_job"}
    assert {d["error_class"] for d in dead_letters(client, keys, "changedrec").values()} == {"bad_job_signature"}
    assert all("task" in d for d in dead_letters(client, keys, "changedrec").values())
    # … a hash that is no hash is dead-lettered, and a claim's part outside the job is never read nor moved.
    assert {pid: d["error_class"] for pid, d in dead_letters(client, keys, "genuine").items()} == {
        "p00009": "bad_content_hash"
    }
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "part_path_refused") == 1
    assert "its claim's part is refused" in log and Path(planted).exists()
    # Nothing genuine is lost or changed: p0, p1 and p2 are stored as the producer signed them (the budget, the
    # revision and the planted row of the forgeries are nowhere), byte for byte against the simulator.
    outcome = check_job(settings, "genuine", prompts, job.sampling_params, expected_dead={"p00009"})
    outcome.assert_clean()
    from storage.reader import read_committed

    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "genuine").to_pylist()}
    assert rows[p2.prompt_id]["output_ids"] != [1, 2, 3] and rows[p2.prompt_id]["worker"] == "w1"
    assert all(r["revision"] == 0 and json.loads(r["sampling_params"])["max_new_tokens"] == 2048 for r in rows.values())
    assert not client.llen(settings.queue)
    assert time.monotonic() - started < 300


def _evil_tokenizer(tmp_path: Path, marker: Path) -> Path:
    """The test tokenizer plus an ``auto_map`` to code that, if a worker ever imported it, leaves ``marker``."""
    import shutil

    evil = tmp_path / "shared-output" / "evil-tokenizer"
    shutil.copytree(build_test_tokenizer(default_test_tokenizer_dir()), evil)
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import "
                                  "PreTrainedTokenizerFast as EvilTokenizer\n")  # fmt: skip
    return evil


def test_a_turns_all_job_runs_only_with_the_code_and_tokenizer_the_worker_allows(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a fleet with a signing key, a --turns all job submitted with --trust-remote-code (its record asks the
    # workers to run its tokenizer's code), and a forged job record — written without the key — whose tokenizer is
    # a directory in the shared output with an auto_map to code that leaves a marker when imported.
    (tmp_path / "logs").mkdir()
    key_file = tmp_path / "signing_key"
    key_file.write_text("t" * 64 + "\n")
    monkeypatch.setenv("THINKFLEET_SIGNING_KEY_FILE", str(key_file))  # the producer CLI and the workers
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    marker = tmp_path / "remote-code-ran"
    evil = _evil_tokenizer(tmp_path, marker)
    data = write_jsonl(tmp_path / "chat.jsonl", conversation_rows(3, 2, 10, "You are a careful assistant."))
    total = 3 * 2
    submitted = producer_cli(
        settings, "submit", str(data), "--job", "chat", "--tokenizer", str(tok_dir), "--processes", "1",
        "--no-progress", "--max-new-tokens", "200", "--context-length", "131072", "--turns", "all",
        "--trust-remote-code", "--json", in_process=True,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    meta = json.loads(client.hget(keys.job("chat"), "turns"))
    assert meta["trust_remote_code"] is True and meta["signature"].startswith("v1:")
    conv = json.loads(next(iter(client.hvals(keys.conversations("chat")))))
    assert conv["signature"].startswith("v1:")
    forged_record = JobRecord(name="forged", tokenizer=str(evil), generation="g1", datasets={"chat": 1}, prompts=1)
    forged_record.save(client, keys)  # no key: what a Redis writer can write
    client.hset(keys.job("forged"), "turns", json.dumps({"mode": "all", "trust_remote_code": True}))
    forged_task = PromptTask("forged", "chat", "c0/t0", 0, content_hash([1, 2]), pack_ids([1, 2]), generation="g1")
    send_tasks(settings, [forged_task])  # genuinely signed: only the record is forged

    def run(name: str, until: object, what: str, **extra: object) -> str:
        worker = WorkerProcess(name, fast_env(settings, sim, max_inflight=4, **extra), tmp_path / "logs").start()
        try:
            worker.wait_ready(client, keys)
            wait_until(until, 120, what=what)  # type: ignore[arg-type]
        finally:
            worker.terminate()
        return worker.log_path.read_text(errors="replace")

    def dead(job: str = "chat") -> dict[str, str]:
        return {pid: d["error_class"] for pid, d in dead_letters(client, keys, job).items()}

    # One simulator for the four workers (each a fleet of its own: what it allows is the scenario).
    with simulator(tmp_path / "logs", "--time-scale", "1000") as sim:
        # A worker that does not allow remote code (the default): the job's turn-0 prompts are dead-lettered, whole.
        log = run("w1", lambda: len(dead()) == 3 and len(dead("forged")) == 1, "remote_code_refused letters")
        assert set(dead().values()) == {"remote_code_refused"}
        assert dead("forged") == {"c0/t0": "unsigned_job"}, "a record without the key is not believed at all"
        assert "THINKFLEET_TRUST_REMOTE_CODE" in log
        # A worker that allows remote code but not loading from that directory: refused again, nothing lost.
        retried = producer_cli(settings, "retry", "chat", "--json", in_process=True)
        assert json.loads(retried.stdout)["requeued"] == 3, retried.stderr
        elsewhere = str(tmp_path / "elsewhere")
        refused_again = lambda: len(dead()) == 3 and set(dead().values()) == {"tokenizer_refused"}  # noqa: E731
        run("w2", refused_again, "tokenizer_refused letters", trust_remote_code="true", tokenizer_roots=elsewhere)
        # A worker that allows both: after a retry every turn of every conversation is stored, chained by workers
        # that signed each next turn and each answer it was rendered from.
        retried = producer_cli(settings, "retry", "chat", "--json", in_process=True)
        assert json.loads(retried.stdout)["requeued"] == 3, retried.stderr
        run("w3", lambda: job_progress(client, keys, "chat")["done"] == total, f"{total} turns",
            trust_remote_code="true")  # fmt: skip
        assert dead() == {}
        answers = [json.loads(v) for v in client.hvals(keys.turn_answers("chat"))]
        assert len(answers) == total and all(a["signature"].startswith("v1:") for a in answers)
        assert not marker.exists(), "the forged record's tokenizer code never ran"
        # A forged record is still refused by a worker without a key when it asks for remote code (its default).
        client.delete(keys.dead("forged"))
        monkeypatch.delenv("THINKFLEET_SIGNING_KEY_FILE")
        send_tasks(Settings(**{**settings.model_dump(), "signing_key_file": None}), [forged_task])
        run("w4", lambda: len(dead("forged")) == 1, "the forged job refused")
    assert dead("forged") == {"c0/t0": "remote_code_refused"}
    assert not marker.exists()
