"""`producer submit job.yaml`: one validated file for every dataset of a job, each with its own columns,
samples and sampling; remote and hub inputs; each row is sent (and stores) its dataset's sampling."""

from __future__ import annotations

import csv
import glob
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import yaml
from click.testing import CliRunner

from producer.cli import cli
from producer.jobfile import JobFileError, load
from storage.reader import read_committed
from testing.corpus import synthetic_text
from testing.datasets import chat_rows, write_jsonl
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import STEADY_LEASE, fast_env, isolated_settings, producer_cli
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from tests.test_storage_s3 import BUCKET, s3_endpoint  # noqa: F401 (the moto S3 server fixture)
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from workers.jobs import JobSpec

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "job.yaml"
#: Prompts per dataset of the example as :func:`write_example_data` writes it (samples counted).
EXAMPLE_PROMPTS = {
    "chat": 6,
    "sharegpt": 5,
    "tool_use": 4,
    "math": 5,
    "code": 6,
    "questions": 4,
    "multilingual": 6,  # 3 rows × samples 2
    "reasoning": 4,  # the train split of a DatasetDict (test has 2 more)
}
#: The example's own budgets; the rest get the job's.
EXAMPLE_BUDGETS = {"math": 4096, "questions": 2048}


@pytest.fixture(scope="module")
def tok_dir() -> str:
    return str(build_test_tokenizer(default_test_tokenizer_dir()))


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def text(i: int, words: int = 12) -> str:
    return synthetic_text(words, 7_000 + i)


def write_example_data(root: Path) -> Path:
    """The eight datasets docs/examples/job.yaml names, in JSONL, Parquet, CSV and save_to_disk."""
    import datasets

    data = root / "data"
    write_jsonl(data / "chat.jsonl", chat_rows(6, words=12))
    write_jsonl(
        data / "sharegpt.jsonl",
        [
            {"id": f"s{i}", "system": "Be brief.",
             "conversations": [{"from": "human", "value": text(i)}, {"from": "gpt", "value": "old"}]}
            for i in range(5)
        ],
    )  # fmt: skip
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    write_jsonl(
        data / "tools.jsonl",
        [{"id": f"t{i}", "messages": [{"role": "user", "content": text(10 + i)}], "tools": tools} for i in range(4)],
    )
    pq.write_table(
        pa.Table.from_pylist([{"problem_id": f"m{i}", "problem": text(20 + i)} for i in range(5)]),
        data / "math.parquet",
    )
    (data / "code").mkdir()
    code = [{"id": f"c{i}", "messages": [{"role": "user", "content": text(30 + i)}]} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(code[:3]), data / "code" / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(code[3:]), data / "code" / "part-1.parquet")
    with (data / "questions.csv").open("w", encoding="utf-8", newline="") as f:
        questions = csv.writer(f)
        questions.writerow(["id", "question", "system"])
        questions.writerows([f"q{i}", text(40 + i), "You answer in one line."] for i in range(4))
    with (data / "multilingual.csv").open("w", encoding="utf-8", newline="") as f:
        multilingual = csv.writer(f)
        multilingual.writerow(["messages"])
        multilingual.writerows([json.dumps([{"role": "user", "content": text(50 + i)}])] for i in range(3))
    rows = [{"id": f"h{i}", "messages": [{"role": "user", "content": text(60 + i)}]} for i in range(6)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    ).save_to_disk(str(data / "reasoning_hf"))
    shutil.copy(EXAMPLE, root / "job.yaml")
    return root / "job.yaml"


def write_job(path: Path, **doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# -- the example -----------------------------------------------------------------------------------------
def test_the_eight_dataset_example_validates_and_enqueues_every_dataset(
    redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path
) -> None:
    # Given the documented example next to its eight datasets in four formats,
    job_file = write_example_data(tmp_path)
    # when it is submitted with the test tokenizer in place of /models/kimi-k2.5,
    code, out, err = run(
        "submit", str(job_file), "--tokenizer", tok_dir, "--redis-url", redis_url,
        "--output-uri", str(tmp_path / "out"), "--processes", "1", "--json", "--no-progress",
    )  # fmt: skip
    # then every dataset's prompts are on the queue, the right number each,
    assert code == 0, err
    report = json.loads(out)
    assert {name: d["enqueued"] for name, d in report["datasets"].items()} == EXAMPLE_PROMPTS
    assert report["enqueued"] == redis_client.llen(Settings().queue) == sum(EXAMPLE_PROMPTS.values())
    # and the job record keeps each dataset's own sampling and samples, the priority and the file.
    record = JobRecord.load(redis_client, Keys(), "k25-eagle3")
    assert record is not None and record.datasets == EXAMPLE_PROMPTS
    assert record.sampling_params["max_new_tokens"] == 10240
    assert record.dataset_sampling == {
        "math": {"max_new_tokens": 4096},
        "questions": {"max_new_tokens": 2048, "temperature": 0.6},
    }
    assert record.dataset_samples == {"multilingual": 2}
    assert record.priority == 0
    spec = JobSpec.from_record(record)
    assert {name: spec.sampling_for(name)["max_new_tokens"] for name in EXAMPLE_PROMPTS} == {
        name: EXAMPLE_BUDGETS.get(name, 10240) for name in EXAMPLE_PROMPTS
    }
    assert record.job_file is not None
    assert record.job_file["tokenizer"] == tok_dir, "the flag given next to the file overrides it"
    assert record.job_file["sampling"]["stop_token_ids"], "defaults are filled in"
    assert record.job_file["chat_template_kwargs"] == {"thinking": True}
    assert record.job_file["model_family"] == "kimi" and record.job_file["turns"] == "last"
    assert [d["name"] for d in record.job_file["datasets"]] == list(EXAMPLE_PROMPTS)
    assert record.job_file["datasets"][5]["sampling"] == {"max_new_tokens": 2048, "temperature": 0.6}
    # `producer status --json` shows the file as it ran.
    code, out, err = run("status", "k25-eagle3", "--json", "--redis-url", redis_url)
    assert code == 0, err
    assert json.loads(out)["job_file"] == record.job_file


def test_the_same_job_file_again_enqueues_nothing_and_a_changed_budget_is_refused(
    redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path
) -> None:
    job_file = write_example_data(tmp_path)
    args = ("--tokenizer", tok_dir, "--redis-url", redis_url, "--output-uri", str(tmp_path / "out"),
            "--processes", "1", "--json", "--no-progress")  # fmt: skip
    assert run("submit", str(job_file), *args)[0] == 0
    code, out, err = run("submit", str(job_file), *args)
    assert code == 0, err
    assert json.loads(out)["enqueued"] == 0
    # A dataset's budget is part of the job: changing it under the same job name is refused.
    job_file.write_text(job_file.read_text().replace("max_new_tokens: 2048", "max_new_tokens: 1024"))
    code, _, err = run("submit", str(job_file), *args)
    assert code == 1
    assert "dataset questions sampling" in err and "new --job name" in err
    assert redis_client.llen(Settings().queue) == sum(EXAMPLE_PROMPTS.values())


# -- per-dataset sampling ------------------------------------------------------------------------------
def test_sampling_for_merges_the_job_then_the_dataset_then_the_message() -> None:
    record = JobRecord.from_hash(
        JobRecord(
            name="j",
            sampling_params={"max_new_tokens": 10240, "temperature": 1.0, "top_p": 0.95, "sampling_seed": 7},
            dataset_sampling={"short": {"max_new_tokens": 2048}, "cool": {"temperature": 0.6, "max_new_tokens": 512}},
        ).to_hash(),
        name="j",
    )
    spec = JobSpec.from_record(record)
    assert spec.sampling_for("plain") == {
        "max_new_tokens": 10240,
        "temperature": 1.0,
        "top_p": 0.95,
        "sampling_seed": 7,
    }
    assert spec.sampling_for("short") == {"max_new_tokens": 2048, "temperature": 1.0, "top_p": 0.95, "sampling_seed": 7}
    assert spec.sampling_for("cool")["temperature"] == 0.6 and spec.sampling_for("cool")["max_new_tokens"] == 512
    # The message's overrides (a retry's budget, a sample's seed) win last, as workers/runtime.py merges them.
    retried = {**spec.sampling_for("short"), **{"max_new_tokens": 4096, "sampling_seed": 8}}
    assert retried["max_new_tokens"] == 4096 and retried["sampling_seed"] == 8
    assert spec.max_new_tokens == 10240, "the job's own budget is unchanged"


def test_a_worker_rereads_the_job_when_a_resubmit_adds_a_dataset_with_its_own_budget(
    redis_url: str, redis_client: redis.Redis
) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from workers.jobs import JobCache

    keys = Keys()
    record = JobRecord(name="grow", datasets={"first": 3}, sampling_params={"max_new_tokens": 10240})
    record.save(redis_client, keys)

    async def budgets() -> tuple[int, int, int]:
        async with aioredis.Redis.from_url(redis_url) as r:
            cache = JobCache(r, keys)
            before = (await cache.get("grow", "first")).sampling_for("first")["max_new_tokens"]
            # A re-submit adds a dataset with its own budget (record and messages land in one MULTI).
            record.datasets["second"] = 2
            record.dataset_sampling = {"second": {"max_new_tokens": 2048}}
            record.save(redis_client, keys)
            cached = (await cache.get("grow", "first")).sampling_for("second")["max_new_tokens"]
            after = (await cache.get("grow", "second")).sampling_for("second")["max_new_tokens"]
            return before, cached, after

    # The first dataset's messages keep the cached spec; the new dataset's first message re-reads it.
    assert asyncio.run(budgets()) == (10240, 10240, 2048)


def test_each_dataset_is_checked_against_the_context_with_its_own_budget(
    redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path
) -> None:
    # Given a 1,200-token context: prompts fit with a 256-token budget, not with the job's 2,048.
    write_jsonl(tmp_path / "short.jsonl", chat_rows(3, words=20, seed=1))
    write_jsonl(tmp_path / "long.jsonl", chat_rows(3, words=20, seed=2))
    job = {"job": "ctx", "tokenizer": tok_dir, "context_length": 1200, "sampling": {"max_new_tokens": 2048}}
    both = write_job(
        tmp_path / "both.yaml", **job,
        datasets=[{"path": "short.jsonl", "sampling": {"max_new_tokens": 256}}, {"path": "long.jsonl"}],
    )  # fmt: skip
    base = ("--redis-url", redis_url, "--output-uri", str(tmp_path / "out"), "--processes", "1", "--no-progress")
    # When both are submitted, only the rows of the dataset on the job's budget are refused, naming them,
    code, _, err = run("submit", str(both), *base)
    assert code == 1
    assert "long.jsonl:1" in err and "short.jsonl" not in err
    assert redis_client.dbsize() == 0, "nothing enqueued"
    # and the dataset with its own budget goes through alone.
    alone = write_job(
        tmp_path / "alone.yaml", **job, datasets=[{"path": "short.jsonl", "sampling": {"max_new_tokens": 256}}]
    )
    code, out, err = run("submit", str(alone), *base, "--json")
    assert code == 0, err
    assert json.loads(out)["enqueued"] == 3
    record = JobRecord.load(redis_client, Keys(), "ctx")
    assert record.dataset_sampling == {"short": {"max_new_tokens": 256}}
    assert record.context_length == 1200


# -- validation --------------------------------------------------------------------------------------------
def test_errors_name_the_file_the_key_path_and_the_fix(tmp_path: Path) -> None:
    path = write_job(
        tmp_path / "job.yaml",
        job="j", tokenizer="/models/kimi", max_new_tokens=2048,
        datasets=[
            {"path": "a.jsonl"}, {"path": "b.jsonl"}, {"path": "c.jsonl"},
            {"path": "d.parquet", "prompt_colum": "question", "sampling": {"max_new_tokens": -5, "max_new_token": 9}},
        ],
    )  # fmt: skip
    with pytest.raises(JobFileError) as caught:
        load(path)
    problems = caught.value.problems
    joined = "\n".join(problems)
    assert f"{path}: max_new_tokens: unknown key; it is a sampling key: put it under `sampling:`" in joined
    assert f"{path}: datasets[3].prompt_colum: unknown key; did you mean `prompt_column`?" in joined
    assert (
        f"{path}: datasets[3].sampling.max_new_tokens: Input should be greater than or equal to 1 (got -5); "
        "expected the generation budget in tokens, e.g. 2048"
    ) in joined
    assert f"{path}: datasets[3].sampling.max_new_token: unknown key; did you mean `max_new_tokens`?" in joined
    assert len(problems) == 4, "every problem at once"


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"tokenizer": "t", "datasets": [{"path": "a.jsonl"}]}, "job: required; add it, e.g. `job: my-job`"),
        ({"job": "j", "tokenizer": "t", "datasets": []}, "datasets: List should have at least 1 item"),
        ({"job": "j:x", "tokenizer": "t", "datasets": [{"path": "a.jsonl"}]}, "job: a job name is letters"),
        ({"job": "j", "tokenizer": "t", "turns": "some", "datasets": [{"path": "a.jsonl"}]},
         "turns: Input should be 'last' or 'all'"),
        ({"job": "j", "tokenizer": "t", "datasets": [{"path": "x/a.jsonl"}, {"path": "y/a.jsonl"}]},
         "datasets[1].name: 'a' is also datasets[0]'s name; give each a distinct `name:`"),
        ({"job": "j", "tokenizer": "t",
          "datasets": [{"path": "a.jsonl", "prompt_column": "p", "messages_column": "m"}]},
         "datasets[0]: set one of messages_column, conversations_column, prompt_column"),
        ({"job": "j", "tokenizer": "t", "datasets": [{"path": "a.jsonl", "sampling": {"top_p": 0}}]},
         "datasets[0].sampling.top_p: Input should be greater than 0 (got 0)"),
        ({"job": "j", "tokenizer": "t", "prompt_column": "q", "datasets": [{"path": "a.jsonl"}]},
         "prompt_column: unknown key; it is set per dataset: put it in each `datasets:` entry"),
    ],
)  # fmt: skip
def test_each_kind_of_mistake_is_named_with_its_fix(tmp_path: Path, doc: dict, expected: str) -> None:
    path = write_job(tmp_path / "job.yaml", **doc)
    with pytest.raises(JobFileError) as caught:
        load(path)
    assert f"{path}: {expected}" in str(caught.value)


def test_yaml_syntax_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job: j\ntokenizer: t\ndatasets:\n  - {path: a.jsonl\n")
    with pytest.raises(JobFileError, match=rf"{path}:\d+:\d+: not valid YAML"):
        load(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(JobFileError, match="not a mapping"):
        load(path)


def test_a_bad_file_enqueues_nothing(redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", chat_rows(3, words=10))
    base = ("--redis-url", redis_url, "--processes", "1", "--no-progress")
    bad = write_job(tmp_path / "bad.yaml", job="bad", tokenizer=tok_dir,
                    datasets=[{"path": "a.jsonl", "sampling": {"max_new_tokens": 0}}])  # fmt: skip
    code, _, err = run("submit", str(bad), *base)
    assert code == 1 and "datasets[0].sampling.max_new_tokens" in err
    # A valid file whose second input is missing fails before anything is enqueued, too.
    missing = write_job(tmp_path / "missing.yaml", job="bad", tokenizer=tok_dir,
                        datasets=[{"path": "a.jsonl"}, {"path": "nope.jsonl"}])  # fmt: skip
    code, _, err = run("submit", str(missing), *base)
    assert code == 1 and "nope.jsonl: no such file or directory" in err
    # `turns: all` takes one sample per conversation; a per-dataset flag next to a file is refused.
    multi = write_job(
        tmp_path / "multi.yaml", job="bad", tokenizer=tok_dir, turns="all", samples=2, datasets=[{"path": "a.jsonl"}]
    )
    code, _, err = run("submit", str(multi), *base)
    assert code == 1 and "--turns all takes one sample per conversation" in err
    ok = write_job(tmp_path / "ok.yaml", job="bad", tokenizer=tok_dir, datasets=[{"path": "a.jsonl"}])
    code, _, err = run("submit", str(ok), "--prompt-column", "q", *base)
    assert code == 1 and "--prompt-column describes PATH inputs: set `prompt_column:`" in err
    assert redis_client.dbsize() == 0


def test_a_model_family_in_the_file_is_checked_as_the_flag_checks_it(
    redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path
) -> None:
    if not any(param.name == "model_family" for param in cli.commands["submit"].params):
        pytest.skip("this producer has no --model-family yet")
    write_jsonl(tmp_path / "a.jsonl", chat_rows(3, words=10))
    family = write_job(
        tmp_path / "family.yaml", job="fam", tokenizer=tok_dir, model_family="kimmi", datasets=[{"path": "a.jsonl"}]
    )
    code, _, err = run("submit", str(family), "--redis-url", redis_url, "--processes", "1", "--no-progress")
    assert code == 1 and "family.yaml: model_family: 'kimmi' is not one of" in err
    assert redis_client.dbsize() == 0


def test_flags_next_to_the_file_override_its_top_level_values(
    redis_url: str, redis_client: redis.Redis, tok_dir: str, tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "a.jsonl", chat_rows(3, words=10))
    path = write_job(
        tmp_path / "job.yaml", job="from-file", tokenizer="/not/here", priority=5,
        sampling={"max_new_tokens": 2048, "temperature": 0.7}, datasets=[{"path": "a.jsonl"}],
    )  # fmt: skip
    code, _, err = run(
        "submit", str(path), "--job", "from-flag", "--tokenizer", tok_dir, "--max-new-tokens", "4096",
        "--redis-url", redis_url, "--processes", "1", "--no-progress", "--json",
    )  # fmt: skip
    assert code == 0, err
    record = JobRecord.load(redis_client, Keys(), "from-flag")
    assert record.sampling_params["max_new_tokens"] == 4096 and record.sampling_params["temperature"] == 0.7
    assert record.priority == 5
    assert record.job_file["job"] == "from-flag" and record.job_file["sampling"]["max_new_tokens"] == 4096
    assert JobRecord.load(redis_client, Keys(), "from-file") is None


# -- remote and hub inputs -------------------------------------------------------------------------------
def test_s3_inputs_in_every_format(
    redis_url: str,
    redis_client: redis.Redis,
    tok_dir: str,
    tmp_path: Path,
    s3_endpoint: str,  # noqa: F811
) -> None:
    import boto3

    # Given JSONL, Parquet, CSV and a save_to_disk directory in a bucket (a moto server over HTTP),
    write_example_data(tmp_path / "local")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    data = tmp_path / "local" / "data"
    for file in sorted(p for p in data.rglob("*") if p.is_file()):
        s3.upload_file(str(file), BUCKET, f"inputs/{file.relative_to(data).as_posix()}")
    uri = f"s3://{BUCKET}/inputs"
    path = write_job(
        tmp_path / "job.yaml", job="remote", tokenizer=tok_dir,
        datasets=[
            {"path": f"{uri}/chat.jsonl"},
            {"path": f"{uri}/math.parquet", "prompt_column": "problem", "id_column": "problem_id"},
            {"path": f"{uri}/code/", "name": "code"},
            {"path": f"{uri}/questions.csv", "prompt_column": "question", "system_column": "system"},
            {"path": f"{uri}/reasoning_hf", "name": "reasoning", "split": "test"},
        ],
    )  # fmt: skip
    # when the job file names them by s3:// URI (the endpoint as storage takes it),
    code, out, err = run(
        "submit", str(path), "--redis-url", redis_url, "--s3-endpoint-url", s3_endpoint,
        "--processes", "1", "--no-progress", "--json",
    )  # fmt: skip
    # then every row is read through pyarrow.fs and enqueued.
    assert code == 0, err
    enqueued = {name: d["enqueued"] for name, d in json.loads(out)["datasets"].items()}
    assert enqueued == {"chat": 6, "math": 5, "code": 6, "questions": 4, "reasoning": 2}
    # A missing key is named before anything is enqueued.
    missing = write_job(tmp_path / "missing.yaml", job="remote2", tokenizer=tok_dir,
                        datasets=[{"path": f"{uri}/chat.jsonl"}, {"path": f"{uri}/nope.jsonl"}])  # fmt: skip
    code, _, err = run("submit", str(missing), "--redis-url", redis_url, "--s3-endpoint-url", s3_endpoint)
    assert code == 1 and f"{uri}/nope.jsonl: no such object or prefix" in err
    assert JobRecord.load(redis_client, Keys(), "remote2") is None


def cache_as_hub_dataset(rows: list[dict], repo_id: str, cache_dir: Path, work: Path) -> None:
    """Leave ``rows`` in a ``datasets`` cache as ``load_dataset(repo_id)`` leaves a hub download: build
    them with the packaged JSON builder, then file them under ``{owner}___{name}/default/0.0.0/<hash>``."""
    import datasets

    write_jsonl(work / "rows.jsonl", rows)
    datasets.load_dataset("json", data_files={"train": str(work / "rows.jsonl")}, cache_dir=str(work / "build"))
    built = Path(glob.glob(str(work / "build" / "json" / "*" / "0.0.0" / "*") + os.sep)[0])
    owner, name = repo_id.split("/")
    target = cache_dir / f"{owner}___{name}" / "default" / "0.0.0" / built.name
    shutil.copytree(built, target)
    (target / "json-train.arrow").rename(target / f"{name}-train.arrow")
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name="default", builder_name=name, dataset_name=name)
    (target / "dataset_info.json").write_text(json.dumps(info))


def test_a_hub_dataset_id_is_read_from_the_local_cache_offline(
    redis_url: str, tok_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a hub dataset in the local datasets cache (no network here: a submit never downloads),
    cache = tmp_path / "hf-cache"
    cache_as_hub_dataset(chat_rows(5, words=10), "acme/tiny_chat", cache, tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    path = write_job(tmp_path / "job.yaml", job="hub", tokenizer=tok_dir,
                     datasets=[{"path": "acme/tiny_chat", "split": "train"}])  # fmt: skip
    # when the job file names it by id, it is read from the cache under its last name part,
    code, out, err = run("submit", str(path), "--redis-url", redis_url, "--processes", "1", "--no-progress", "--json")
    assert code == 0, err
    assert json.loads(out)["datasets"]["tiny_chat"]["enqueued"] == 5
    # and an id the cache does not hold is refused naming the cache and the fix.
    missing = write_job(tmp_path / "missing.yaml", job="hub2", tokenizer=tok_dir, datasets=[{"path": "acme/absent"}])
    code, _, err = run("submit", str(missing), "--redis-url", redis_url, "--processes", "1")
    assert code == 1
    assert "acme/absent: no such file or directory, and no Hugging Face dataset 'acme/absent'" in err
    assert str(cache) in err and "load it once where the hub is reachable" in err


# -- the acceptance run ------------------------------------------------------------------------------------
def test_one_job_file_runs_to_completion_on_two_hosts_with_each_dataset_budget(
    redis_url: str, tok_dir: str, tmp_path: Path
) -> None:
    from sglang_sim.content import expected_generation
    from sglang_sim.testing import SimulatorProcess

    # Given the eight-dataset example, one simulated SGLang server and two real workers ("two hosts"),
    job_file = write_example_data(tmp_path)
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    (tmp_path / "logs").mkdir()
    sim = SimulatorProcess("--time-scale", "400", "--context-length", "16384").start()
    workers = [
        WorkerProcess(f"host{i}", fast_env(settings, sim.url, max_inflight=8, **STEADY_LEASE), tmp_path / "logs")
        for i in (1, 2)
    ]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(client, settings.keys)
        # when one `producer submit job.yaml` runs (the job's budget lowered by a flag; math and questions
        # keep their own),
        submitted = producer_cli(
            settings, "submit", str(job_file), "--tokenizer", tok_dir, "--max-new-tokens", "1024",
            "--context-length", "16384", "--processes", "1", "--no-progress", "--json", in_process=True,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        total = sum(EXAMPLE_PROMPTS.values())
        assert json.loads(submitted.stdout)["enqueued"] == total
        wait_until(lambda: job_progress(client, settings.keys, "k25-eagle3")["done"] == total, 240, what="every row")
        waited = producer_cli(settings, "wait", "k25-eagle3", "--timeout", "60", "--json", in_process=True)
        verified = producer_cli(settings, "verify", "k25-eagle3", "--json", in_process=True)
        rows = read_committed(settings.output_uri, "k25-eagle3").to_pylist()
    finally:
        for w in workers:
            w.terminate()
        sim.stop()
    # then it ran to completion on both hosts, `producer verify` is OK,
    assert waited.returncode == 0, waited.stderr
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert len(rows) == total and {r["worker"] for r in rows} == {"host1", "host2"}
    # and every row's sampling_params shows its dataset's budget — the one the server was sent.
    budgets = {**dict.fromkeys(EXAMPLE_PROMPTS, 1024), **EXAMPLE_BUDGETS}
    for row in rows:
        params = json.loads(row["sampling_params"])
        assert params["max_new_tokens"] == budgets[row["dataset"]], row["prompt_id"]
        assert params["temperature"] == (0.6 if row["dataset"] == "questions" else 1.0)
        assert row["output_ids"] == expected_generation(row["input_ids"], params).output_ids, row["prompt_id"]
    assert {r["dataset"] for r in rows} == set(EXAMPLE_PROMPTS)
