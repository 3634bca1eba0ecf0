"""verify, report, export and compact read a job in batches (storage/stream.py) and give what they gave when they
read it whole: the golden digests below are of the outputs of the code before streaming (commit 2ca13a7; verify,
report and hf re-taken from a whole read when they gained fields: images checked, prefix cache, assistant_masks),
run on the same synthetic job (bench/scale_job.py writes it byte for byte the same every time), and a memory setting too
small for the job (two passes, batches, sorted runs spilled to temporary files) changes none of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.scale_command import run
from bench.scale_job import tree_digests, write_job
from storage import layout, reader, stream
from storage.exports import export_job
from storage.schema import CONVERSATION_ID, PROMPT_ID, SCHEMA, TURN_INDEX
from storage.writer import PartWriter
from testing.rows import make_row
from thinkfleet.settings import Settings
from workers.committer import GroupCommitter, _Pending

JOB = "job"
#: Outputs of the pre-streaming code on write_job(…, 1500 prompts, 9 rows a part): 174 parts, 1554 stored rows with
#: fenced rows, retries and duplicates among them.
GOLDEN_SHORT = {
    "verify": "35457d59a5994a1c05cd037dcf3a368eb32cc37bd6d868ba8363136ec29beaed",
    "report": "6d01ef92f0bc5d7ae471f590720064dcd915cd04e69765a879bdf3b96c491bf6",
    "export-eagle3": "41fa85b78fca0a38e6d9f65e29c6f113577aa8d0dfbbbe0d80ba6372b165901a",
    "export-eagle3-jsonl": "71171855431d8c2f05faa53765ccc0a3cdfc82063960f5c8de57854784029fa6",
    "export-specforge": "a3b919299d9cfc73fa28f526a1fcfaab228f6ac0ca1e6c4fbc4385d10c86445b",
    "export-hf": "3db990b5bcb247046f93c297dad76a98e96a7d70767af256db343586b2e16ce4",
    "compact": "4cbd1fea23e583eebc7f2593615dea682accf496df4c86ffb2933caf95c146f6",
}
#: … on write_job(…, 1200 prompts, 9 rows a part, 20x longer outputs).
GOLDEN_LONG = {
    "verify": "ade6d6aa9b1747a3d2a9560ca23f9a9c9fea731f235b1d96c7376cac6e069731",
    "report": "e73492cfdc3e65f3a3c960c77c600bd4c51ed7120d87d3d02644095ad151c007",
    "export-eagle3": "f766581967247326391407ed52964bec5f9162abeeab0a39bdb6b74491378a56",
    "export-eagle3-jsonl": "0ad8e94caf38f755489573fc3e64f8e0f5ac39471ba380936ba23137f17e6d4f",
    "export-specforge": "dc1aea2182f0707405bc2039e6038cfd24a2ad1b8dac207ff84c61b0e2947b9f",
    "export-hf": "b1a553263342b851a49b935f6a2dc3d005057fb3c70132dc1e6d05260aca45a5",
    "compact": "45fe5cf9ae240c372c0f7d612cfeea24a6a91c52b1711f7f7a7cd690825949ba",
}


def _settings(root: Path, memory_mb: int | None = None) -> Settings:
    extra = {"storage_memory_mb": memory_mb} if memory_mb else {}
    return Settings(output_uri=str(root), key_prefix=f"stream-test-{root.name}", **extra)


def _run_all(root: Path, tmp: Path, settings: Settings, commands: list[str]) -> dict[str, str]:
    out = {}
    for cmd in commands:
        target = tmp / f"out-{cmd}"
        if cmd == "compact":  # compacts in place: a copy
            copy = tmp / "compacted"
            shutil.copytree(root, copy)
            settings = settings.model_copy(update={"output_uri": str(copy)})
            out[cmd] = str(run(cmd, str(copy), JOB, str(target), settings)["digest"])
        else:
            target.mkdir()
            out[cmd] = str(run(cmd, str(root), JOB, str(target), settings)["digest"])
    return out


def test_every_command_gives_what_the_whole_read_gave(tmp_path: Path) -> None:
    # Given a job as a fleet leaves it: hundreds of small parts, fenced rows, retried prompts, duplicates
    root = tmp_path / "store"
    assert write_job(str(root), JOB, 1500, rows_per_part=9) == 174
    # When every storage command reads it (it fits the memory setting: one pass)
    got = _run_all(root, tmp_path, _settings(root), list(GOLDEN_SHORT))
    # Then each output is byte for byte the pre-streaming one (hf: every file but state.json's fingerprint)
    assert got == GOLDEN_SHORT


def test_a_job_larger_than_the_memory_setting_is_read_in_two_passes_and_changes_nothing(tmp_path: Path) -> None:
    # Given a job of long outputs, too large for one pass under a 16 MiB setting
    root = tmp_path / "store"
    write_job(str(root), JOB, 1200, rows_per_part=9, scale=20)
    small = _settings(root, memory_mb=16)
    # When the commands read it in two passes (keys, then the winners' rows in batches of 2 MiB)
    commands = [c for c in GOLDEN_LONG if c != "export-eagle3"]
    got = _run_all(root, tmp_path, small, commands)
    # Then the outputs are the pre-streaming ones
    assert got == {c: GOLDEN_LONG[c] for c in commands}
    # And eagle3's Parquet has the same rows (a dataset larger than a quarter of the setting is cut into several row
    # groups: one is held in memory)
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    whole.mkdir(), streamed.mkdir()
    assert run("export-eagle3", str(root), JOB, str(whole), _settings(root))["digest"] == GOLDEN_LONG["export-eagle3"]
    run("export-eagle3", str(root), JOB, str(streamed), small)
    before, after = pq.ParquetFile(whole / "x.parquet"), pq.ParquetFile(streamed / "x.parquet")
    assert after.metadata.num_row_groups >= before.metadata.num_row_groups
    assert after.read().equals(before.read())
    # And shards with filters are the same files whichever the memory setting
    shards = {}
    for label, settings in (("whole", _settings(root)), ("small", small)):
        out = tmp_path / f"shards-{label}"
        res = export_job(settings, JOB, "specforge", str(out / "x.jsonl"), shard_rows=300, drop_truncated=True,
                         exclude_reasoning=True)  # fmt: skip
        # (the provenance sidecar names the export's time and settings: the data files are compared)
        data = {name: d for name, d in tree_digests(str(out)).items() if not name.endswith(".provenance.json")}
        shards[label] = (data, res.skipped)
    assert shards["whole"] == shards["small"] and len(shards["whole"][0]) > 2


@pytest.mark.parametrize("memory", [1 << 20, 100_000])
def test_batches_concatenate_to_the_committed_view(tmp_path: Path, memory: int) -> None:
    # Given conversations (a later turn stored twice, one fenced), single rows and fenced rows across many parts
    writer = PartWriter(str(tmp_path), "w1")
    for c in range(16):
        for t in range(4):
            row = make_row(f"c{c:03d}/t{t}", seed=c * 4 + t, row_index=c, conversation_id=f"c{c:03d}", turn_index=t,
                           turn_count=4, epoch=2)  # fmt: skip
            writer.write(JOB, "ds", [row])
        writer.write(JOB, "ds", [make_row(f"c{c:03d}/t2", seed=99, row_index=c, conversation_id=f"c{c:03d}",
                                          turn_index=2, turn_count=4, epoch=1)])  # fmt: skip
    writer.write(JOB, "ds", [make_row(f"s-{i:03d}", seed=i, row_index=100 + i) for i in range(20)])
    loc = layout.locate(str(tmp_path))
    whole = reader.read_committed(str(tmp_path), JOB, SCHEMA.names)
    # When it is read in batches of a memory share — sorted runs spilled to temporary files, as the whole job is far
    # over the setting — with a conversation kept in one batch
    batches = list(
        stream.committed_batches(
            loc, JOB, SCHEMA.names, memory_bytes=memory, batch_bytes=memory // 64, group_by=CONVERSATION_ID
        )
    )
    # Then the batches are the committed view, in its order, and no conversation spans two of them
    assert pa.concat_tables(batches).equals(whole)
    seen: dict[str, int] = {}
    for n, table in enumerate(batches):
        for conv in set(table[CONVERSATION_ID].drop_null().to_pylist()):
            assert seen.setdefault(conv, n) == n, f"{conv} split between batches"
    assert len(batches) > 1
    # And another order (compaction's) gives the same rows in that order
    by_turn = list(
        stream.committed_batches(
            loc,
            JOB,
            [PROMPT_ID, TURN_INDEX],
            memory_bytes=memory,
            order_columns=[TURN_INDEX],
            order=lambda w: np.lexsort((np.arange(w.num_rows), w[TURN_INDEX].fill_null(-1))),
        )
    )
    turns = pa.concat_tables(by_turn)[TURN_INDEX].fill_null(-1).to_numpy()
    assert (np.diff(turns) >= 0).all() and len(turns) == whole.num_rows


def test_a_group_commit_larger_than_the_part_target_is_cut() -> None:
    # Given a committer whose part target is 10 kB and rows of ~4 kB
    committer = GroupCommitter(None, None, 512, 1.0, 100, 0.95, lambda *a: None, part_target_bytes=10_000)  # type: ignore[arg-type]
    items = [_Pending("j", "d", {}, None, None, 4_000) for _ in range(7)]  # type: ignore[arg-type]
    # Then a flush takes the rows that fit the target (at least one, even if larger)
    assert committer._within_target(items) == 2
    assert committer._within_target([_Pending("j", "d", {}, None, None, 50_000)]) == 1  # type: ignore[arg-type]
