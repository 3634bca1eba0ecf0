"""verify, report, export and compact read a job in batches (storage/stream.py) and give what they gave when they
read it whole: the golden digests below are of the outputs of the code before streaming (commit 2ca13a7, run on the
same synthetic job — bench/scale_job.py writes it byte for byte the same every time), and a memory setting too
small for the job (sorted runs spilled to temporary files) changes none of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.scale_command import run
from bench.scale_job import write_job
from storage import layout, reader, stream
from storage.schema import CONVERSATION_ID, PROMPT_ID, SCHEMA, TURN_INDEX
from storage.writer import PartWriter
from testing.rows import make_row
from thinkfleet.settings import Settings
from workers.committer import GroupCommitter, _Pending

JOB = "job"
#: Outputs of the pre-streaming code on write_job(…, 3000 prompts, 9 rows a part): 346 parts, 3108 stored rows with
#: fenced rows, retries and duplicates among them.
GOLDEN_SHORT = {
    "verify": "5513683ab80cb4f9f1677b39c470524fcaa295e7e61925db60060335aa1de4b7",
    "report": "5fd11317b7be11573e23ee173d048c71bd41f68e23b2156dc157a62d230a3c1b",
    "export-eagle3": "db62776c8b616595ed1bfb92ed9c51476fb020a1366eb100c096124fd870ceba",
    "export-eagle3-jsonl": "c8616a7310c5dc7961a819c45f0a41f15c75719cb171f775e85d8cb1d7e353bc",
    "export-specforge": "f051de6d02dda92407850bc1a94af25c6ee6b2ca9b9c5da9f3e4494894f0c9e3",
    "export-hf": "6915db067488fc7c477cc109d9c00170931b580d5c3f39be902530b05fd625b6",
    "compact": "c107d3b7597de7c0fe8b13a5a94b4342326eaf6467eab797599adce31326d40b",
}
#: … on write_job(…, 2000 prompts, 9 rows a part, 20x longer outputs).
GOLDEN_LONG = {
    "verify": "cff579e16732b735b194a2583c0d7f26ef9672253fdb94325da7c453f353d793",
    "report": "8a81f17f37e8839a3960db37b35c79c54ae40be692282bf15bf79ebbaa0e1ed9",
    "export-eagle3": "ff458e901c3c58ccde17a085de9f06b9bf2553a5e995d24eae9abf38273181e9",
    "export-eagle3-jsonl": "10448482f29b8ee5763867c1b4251b936a612d38426be6f97fae6027e1bac9b4",
    "export-specforge": "d1eeb19decb36b3668c606de481059b5d1d26dc68658374beef8431e47742d6b",
    "export-hf": "0afc9818f4d175c51f7908340b56d95b02117a2a523270caed33eb72c31ea168",
    "compact": "70fde03501fbfc8ec45becbaac70b51a24607550aee51e3c70432a2091a9b23d",
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
    assert write_job(str(root), JOB, 3000, rows_per_part=9) == 346
    # When every storage command reads it (it fits the memory setting: one pass)
    got = _run_all(root, tmp_path, _settings(root), list(GOLDEN_SHORT))
    # Then each output is byte for byte the pre-streaming one (hf: every file but state.json's fingerprint)
    assert got == GOLDEN_SHORT


def test_a_job_larger_than_the_memory_setting_spills_and_changes_nothing(tmp_path: Path) -> None:
    # Given a job of long outputs, ~3x the sort run that 16 MiB allows
    root = tmp_path / "store"
    write_job(str(root), JOB, 2000, rows_per_part=9, scale=20)
    small = _settings(root, memory_mb=16)
    # When the commands run in two passes, spilling sorted runs
    commands = [c for c in GOLDEN_LONG if c != "export-eagle3"]
    got = _run_all(root, tmp_path, small, commands)
    # Then the outputs are the pre-streaming ones
    assert got == {c: GOLDEN_LONG[c] for c in commands}
    # And eagle3's Parquet has the same rows, cut into smaller row groups (a row group is held in memory)
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    whole.mkdir(), streamed.mkdir()
    assert run("export-eagle3", str(root), JOB, str(whole), _settings(root))["digest"] == GOLDEN_LONG["export-eagle3"]
    run("export-eagle3", str(root), JOB, str(streamed), small)
    before, after = pq.ParquetFile(whole / "x.parquet"), pq.ParquetFile(streamed / "x.parquet")
    assert after.metadata.num_row_groups > before.metadata.num_row_groups
    assert after.read().equals(before.read())


@pytest.mark.parametrize("memory", [1 << 30, 1 << 20, 100_000])
def test_batches_concatenate_to_the_committed_view(tmp_path: Path, memory: int) -> None:
    # Given conversations (a later turn stored twice, one fenced), single rows and fenced rows across many parts
    writer = PartWriter(str(tmp_path), "w1")
    for c in range(30):
        for t in range(4):
            row = make_row(f"c{c:03d}/t{t}", seed=c * 4 + t, row_index=c, conversation_id=f"c{c:03d}", turn_index=t,
                           turn_count=4, epoch=2)  # fmt: skip
            writer.write(JOB, "ds", [row])
        writer.write(JOB, "ds", [make_row(f"c{c:03d}/t2", seed=99, row_index=c, conversation_id=f"c{c:03d}",
                                          turn_index=2, turn_count=4, epoch=1)])  # fmt: skip
    writer.write(JOB, "ds", [make_row(f"s-{i:03d}", seed=i, row_index=100 + i) for i in range(40)])
    loc = layout.locate(str(tmp_path))
    whole = reader.read_committed(str(tmp_path), JOB, SCHEMA.names)
    # When it is read in batches of a memory share, a conversation kept in one batch
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
    if memory < 1 << 20:
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
