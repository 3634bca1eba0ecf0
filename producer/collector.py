"""Rendered prompts → what a submit keeps of them: manifest rows, statistics, prompt hashes and the messages of the
prompts to enqueue (:class:`Collector`); the manifest rows wait in a local file until the submit commits
(:class:`ManifestSpool`).

Apart from :mod:`producer.submit` because this is the per-prompt bookkeeping of a submission (is each sample new,
queued, done, dead, changed; what will the job hold), the part whose memory must stay flat with the dataset's size.
"""

from __future__ import annotations

import collections
import pickle
import tempfile
import uuid
from array import array
from collections.abc import Iterator
from typing import Any

from producer import render
from producer.feed import Feed, Input
from producer.images import ImageError, place_images
from producer.inputs import Problem, Prompt
from producer.report import HASH_ENTRY_OVERHEAD_B, DatasetReport
from producer.state import Existing, PromptStager, write_manifest
from producer.submit_options import SubmitOptions
from thinkfleet.broker.envelope import Envelope
from thinkfleet.message import PromptTask, content_hash, unpack_ids
from thinkfleet.settings import Settings
from thinkfleet.state.job import sample_overrides
from thinkfleet.vision import ImageRef, expanded_length

#: prompt_id of sample k when --samples > 1: "<dataset>/<id>#<k>".
SAMPLE_SEP = "#"


class Collector:
    """Turns rendered prompts into manifest rows, statistics and the messages of prompts to enqueue."""

    def __init__(
        self,
        opts: SubmitOptions,
        existing: Existing,
        params: dict[str, Any],
        problems: list[Problem],
        envelope: Envelope,
        limits: render.ModelLimits,
        tok: Any,
        inputs: list[Input],
    ) -> None:
        self.opts, self.existing, self.params, self.problems = opts, existing, params, problems
        self.envelope, self.limits, self.tok = envelope, limits, tok
        #: each dataset's sampling, samples and budget (the largest max_new_tokens any sample of a row gets).
        self.inputs = {inp.dataset.name: inp for inp in inputs}
        self.finished = existing.finished
        self.reports: dict[str, DatasetReport] = collections.defaultdict(DatasetReport)
        #: manifest rows (every valid prompt of this submission), spooled to a local file until the submit commits
        self.spool = ManifestSpool(keep=not opts.dry_run)  # a dry run writes no manifest: nothing to spool
        self.prompt_stager: PromptStager | None = None  # where the prompt hashes go (None: a dry run)
        self.lengths = array("I")  # prompt lengths in tokens (4 bytes a prompt)
        self.new_per_dataset: collections.Counter[str] = collections.Counter()  # prompts new to the job
        self.new_prompt_tokens = 0
        self.hash_bytes = 0  # what the prompt hashes will cost Redis (the report's estimate)
        self.kept_conversations: set[str] = set()  # --turns all: conversations with a valid turn 0
        self.revived: list[tuple[str, str]] = []  # (prompt_id, dataset): done, but lost with a damaged part
        self.lost = existing.lost
        self.stored_hint: dict[str, str] = {}  # dataset of stored prompts (the done refill after a Redis loss)
        self.message_bytes = self.enqueued = self.tokens_enqueued = 0
        #: --turns all: conversations whose stored turns the workers finalize again (producer/chains.py)
        self.resumed = 0
        self.not_ending = self.changed = self.batch_tokens = 0
        self.first_not_ending: str | None = None
        #: image prompts enqueued, their images, and what their messages cost Redis (docs/vision.md)
        self.image_prompts = self.images = self.image_message_bytes = 0
        self.feed: Feed | None = None  # the inputs being rendered (--turns all: their conversations)
        #: The record's generation: kept from the existing record, else a new one (a first submit, or after purge).
        self.generation = (existing.record.generation if existing.record else "") or uuid.uuid4().hex[:16]

    def add_batch(self, prompts: list[tuple[str, Prompt]], results: list[render.Result]) -> list[bytes]:
        tasks: list[PromptTask] = []
        self.batch_tokens = 0
        for (dataset, prompt), result in zip(prompts, results, strict=True):
            if isinstance(result, str):
                self.problems.append(Problem(prompt.location, f"{result}; fix the row or pass --skip-invalid"))
                continue
            self.batch_tokens += result[1]
            tasks.extend(self._add(dataset, prompt, *result))
        messages = self.envelope.encode_many(tasks) if tasks else []
        self.message_bytes += sum(map(len, messages))
        for task, message in zip(tasks, messages, strict=True):
            if task.media:
                self.image_prompts += 1
                self.images += len(task.media)
                self.image_message_bytes += len(message)
        self.enqueued += len(messages)
        return messages

    def _add(
        self, dataset: str, prompt: Prompt, blob: bytes, n_tokens: int, digest: str, ends: bool, max_id: int
    ) -> list[PromptTask]:
        opts, inp = self.opts, self.inputs[dataset]
        if opts.max_prompt_tokens and n_tokens > opts.max_prompt_tokens:
            reason = f"prompt is {n_tokens} tokens, over --max-prompt-tokens {opts.max_prompt_tokens}"
            self.problems.append(Problem(prompt.location, f"{reason}; shorten it, raise the limit, or --skip-invalid"))
            return []
        media: tuple[ImageRef, ...] = ()
        if prompt.images:  # each placeholder found in the ids; the hash binds the images too (thinkfleet/message.py)
            try:
                media, digest = self._place(dataset, prompt, blob)
            except ImageError as e:
                self.problems.append(Problem(prompt.location, f"{e} (--skip-invalid skips and records it)"))
                return []
        # SGLang checks the context on the prompt as its image processor expands it: each placeholder → its tokens.
        length = expanded_length(n_tokens, media)
        unfit = render.check_prompt(length, max_id, inp.budget, self.limits)
        if unfit is not None:
            if max_id >= self.limits.vocab_size:  # rare: unpack the ids to name the first one out of range
                unfit = render.check_prompt(length, max_id, inp.budget, self.limits, unpack_ids(blob, None), self.tok)
            if media:
                images = sum(m.tokens for m in media)
                unfit += (
                    f" ({n_tokens:,} ids, each of its {len(media)} image placeholder(s) expanded: {images:,} tokens)"
                )
            self.problems.append(Problem(prompt.location, f"{unfit} (--skip-invalid skips and records it)"))
            return []
        if not ends:
            self.not_ending += 1
            self.first_not_ending = self.first_not_ending or prompt.location
        self.lengths.append(n_tokens)
        report = self.reports[dataset]
        tasks = []
        for k in range(inp.samples):
            pid = prompt.prompt_id if inp.samples == 1 else f"{prompt.prompt_id}{SAMPLE_SEP}{k}"
            old = self.existing.hashes.get(pid)
            if old is not None and old != digest:
                self.changed += 1
                self.problems.append(Problem(
                    prompt.location,
                    f"content changed since job {opts.job!r} was first submitted ({pid}: {old} → {digest}); "
                    "use a new --job name, or --skip-invalid to keep the first version",
                ))  # fmt: skip
                continue
            report.prompts += 1
            report.prompt_tokens += n_tokens
            self._row({"prompt_id": pid, "dataset": dataset, "row_index": prompt.row_index,
                       "sample_index": k, "content_hash": digest, "prompt_tokens": n_tokens,
                       # the source conversation, kept in the manifest for `export --format messages`
                       "messages": prompt.messages, "tools": prompt.tools})  # fmt: skip
            if pid in self.finished:
                report.already_done += 1
            elif pid in self.existing.dead:
                report.dead += 1
            elif pid in self.existing.queued:
                report.already_queued += 1
            else:
                report.enqueued += 1
                self.tokens_enqueued += n_tokens
                overrides = sample_overrides(inp.params, k, inp.samples)
                tasks.append(
                    PromptTask(
                        opts.job, dataset, pid, prompt.row_index, digest, blob, k, 0, overrides, self.generation,
                        media=media,
                    )
                )  # fmt: skip
        return tasks

    def _place(self, dataset: str, prompt: Prompt, blob: bytes) -> tuple[tuple[ImageRef, ...], str]:
        """An image prompt's references with their placeholders' positions, and its content hash (ids + images)."""
        resolver = self.inputs[dataset].dataset.images
        assert resolver is not None, "a prompt with images was read without an image resolver"
        ids = unpack_ids(blob, None)
        media = place_images(ids, prompt.images, resolver.vision.placeholder)
        return media, content_hash(ids, [m.sha256 for m in media])

    def _row(self, row: dict[str, Any]) -> None:
        """A valid prompt of this submission: spooled for the manifest, its hashes staged, its numbers kept."""
        pid, dataset = row["prompt_id"], row["dataset"]
        self.spool.add(row)
        if self.prompt_stager is not None:
            self.prompt_stager.add(pid, row["content_hash"], dataset)
        self.hash_bytes += 2 * (len(pid) + HASH_ENTRY_OVERHEAD_B) + 16 + len(dataset)
        if pid not in self.existing.datasets:
            self.new_per_dataset[dataset] += 1
        if pid not in self.existing.hashes:
            self.new_prompt_tokens += row["prompt_tokens"]
        if pid in self.lost:
            self.revived.append((pid, dataset))
        if pid in self.existing.stored:
            self.stored_hint[pid] = dataset
        if self.opts.turns == "all":
            from thinkfleet.turns import split_turn_id

            self.kept_conversations.add(split_turn_id(pid)[0])  # type: ignore[index]


class ManifestSpool:
    """Manifest rows kept in a local temporary file (pickled chunks) until the submit is sure to commit, then
    written to storage a chunk per manifest file: memory holds one chunk, not the submission."""

    #: Rows held in memory before they are spooled to the file (a few MB with their source messages).
    CHUNK = 5_000
    #: Rows per manifest file written to storage (the write holds this many, and their Arrow table, at once).
    FILE_ROWS = 25_000

    def __init__(self, keep: bool = True) -> None:
        # closed by close() (the submit's finally), not a with-block: the spool lives across the render loop.
        # On disk it takes about what the dataset's messages take in its own files.
        self._file = tempfile.TemporaryFile(prefix="thinkfleet-manifest-")  # noqa: SIM115
        self._chunk: list[dict[str, Any]] = []
        self.keep = keep
        self.rows = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        if not self.keep:
            return
        self._chunk.append(row)
        if len(self._chunk) >= self.CHUNK:
            self._dump()

    def _dump(self) -> None:
        if self._chunk:
            pickle.dump(self._chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._chunk = []

    def chunks(self) -> Iterator[list[dict[str, Any]]]:
        self._dump()
        self._file.seek(0)
        while True:
            try:
                yield pickle.load(self._file)  # our own file, written above: trusted
            except EOFError:
                return

    def write(self, settings: Settings, job: str) -> None:
        """Every row to storage's manifest, :data:`FILE_ROWS` per file (a submission of no rows writes one empty
        file, as a submit always wrote one)."""
        rows: list[dict[str, Any]] = []
        wrote = False
        for chunk in self.chunks():
            rows += chunk
            if len(rows) >= self.FILE_ROWS:
                write_manifest(settings, job, rows)
                rows, wrote = [], True
        if rows or not wrote:
            write_manifest(settings, job, rows)

    def close(self) -> None:
        self._chunk = []
        self._file.close()
