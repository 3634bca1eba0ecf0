"""Which server made a job's rows, recorded beside them: a post-commit hook (workers/hooks.py).

So that a drafter trained on the data can be traced and the data reproduced, every worker records, once per job and
server configuration, what served the job: the server's SGLang version, ``/model_info`` and launch arguments as the
health gate read them (workers/sglang.py ``launch_record``; tensor/data parallelism, quantization,
``--reasoning-parser``, speculative decoding, ``weight_version``, …), the model directory's config hashes when this
worker can read that directory, thinkfleet's version and git revision, and the job's sampling, seeds, tokenizer
fingerprint and chat-template hash. Several servers, or one restarted with other arguments, make several records;
each row names its configuration (``server_config``).

Where: ``{OUTPUT_URI}/{job}/_provenance/`` (storage/manifest.py), not Redis. Storage is the durable record of a job —
it outlives a lost or purged Redis, and ``producer report`` and every export read the rows from it, and now their
provenance beside them. The record is written in :meth:`ProvenanceRecorder.before_write`, before the first part of
the job holding rows of that configuration: a failed write fails that commit, which is retried as any storage
failure is, so no stored row ever names a configuration without its record. The hot path pays a dict read per row
and a set lookup per commit group; the write happens once per job, server configuration and worker life.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any

from storage import layout
from storage.manifest import PROVENANCE_KIND, software, write_provenance
from storage.schema import SERVER_CONFIG
from workers.health import HealthGate
from workers.hooks import CommitGroup, FinalizeWrites, PostCommitHook
from workers.jobs import JobCache, JobSpec
from workers.sglang import LAUNCH_HIGHLIGHTS, ServerInfo

log = logging.getLogger("thinkfleet.worker")

#: The model directory's files hashed into a record (the model's shape and its generation defaults).
MODEL_FILES = ("config.json", "generation_config.json")
#: How samples of one prompt get their seeds (``thinkfleet.state.job.sample_overrides``).
SEED_RULE = "sampling_seed + sample_index for each sample of a prompt (none: the server's own sampling)"


class ProvenanceRecorder(PostCommitHook):
    """Records each (job, server configuration) this worker stores rows of, once, before those rows' part.

    :attr:`gate` (set once the worker's health gate exists) holds what was read of the server: ``gate.info`` now,
    ``gate.known`` every configuration by its digest. A row built without a ``server_config`` gets the current one.
    """

    name = "provenance"

    def __init__(
        self, loc: layout.Location, jobs: JobCache, worker: str, sglang_url: str, git_revision: str | None = None
    ) -> None:
        self.loc = loc
        self.jobs = jobs
        self.worker = worker
        self.sglang_url = sglang_url
        self.git_revision = git_revision
        self.gate: HealthGate | None = None
        self._recorded: set[tuple[str, str]] = set()
        self._model_files: dict[str, dict[str, Any]] = {}

    async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
        current = self.gate.info if self.gate is not None else None
        configs: set[str] = set()
        for row in group.rows:
            config = row.get(SERVER_CONFIG)
            if config is None and current is not None:
                config = row[SERVER_CONFIG] = current.config_digest
            if config is not None:
                configs.add(config)
        for config in configs:
            if (group.job, config) not in self._recorded:
                await self._record(group.job, config)
        return None

    async def _record(self, job: str, config: str) -> None:
        info = self.gate.known.get(config) if self.gate is not None else None
        if info is None:  # a row names a server this worker never read: nothing true to write about it
            log.error("job %s: rows name server configuration %s, which this worker never read", job, config)
            self._recorded.add((job, config))
            return
        if info.model_path not in self._model_files:
            self._model_files[info.model_path] = await asyncio.to_thread(model_files, info.model_path)
        try:
            facts = job_facts(await self.jobs.get(job))
        except Exception as exc:  # the rows carry their sampling and tokenizer too: the server's facts still go
            log.warning("job %s: its record is unreadable (%s): provenance without the job's facts", job, exc)
            facts = {"error": f"{type(exc).__name__}: {exc}"}
        record = server_record(job, info, self.worker, self.sglang_url, self._model_files[info.model_path])
        record["job_facts"] = facts
        record["thinkfleet"] = software(self.git_revision)
        uri = await asyncio.to_thread(write_provenance, self.loc, job, record)
        self._recorded.add((job, config))
        log.info("job %s: recorded server configuration %s (SGLang %s) in %s", job, config, info.version, uri)


def server_record(
    job: str, info: ServerInfo, worker: str, sglang_url: str, model_config: dict[str, Any]
) -> dict[str, Any]:
    """One record's server part (storage/manifest.py names its layout ``PROVENANCE_KIND``)."""
    args = dict(info.launch_args)
    return {
        "kind": PROVENANCE_KIND,
        "job": job,
        "worker": worker,
        "worker_host": socket.gethostname(),
        "sglang_url": sglang_url,
        "recorded_at": datetime.now(UTC).isoformat(),
        "server_config": info.config_digest,
        "server": {
            "version": info.version,
            "model_info": dict(info.model_info),
            "highlights": {k: args[k] for k in LAUNCH_HIGHLIGHTS if args.get(k) is not None},
            "launch_args": args,
            "source": "GET /model_info and /server_info when the worker's health gate opened",
        },
        "model_config": model_config,
    }


def job_facts(spec: JobSpec) -> dict[str, Any]:
    """What the job asked for: its sampling (per dataset where a job file set it), seeds, tokenizer, template."""
    record = spec.record
    return {
        "sampling_params": dict(spec.sampling_params),
        "dataset_sampling": {k: dict(v) for k, v in spec.dataset_sampling.items()},
        "sampling_seed": spec.sampling_params.get("sampling_seed"),
        "seed_rule": SEED_RULE,
        "tokenizer": spec.tokenizer or None,
        "tokenizer_fingerprint": spec.tokenizer_fingerprint,
        "chat_template_hash": spec.chat_template_hash,
        "expected_model": spec.expected_model,
        "model_family": record.model_family if record is not None else None,
        "generation": spec.generation or None,
    }


def model_files(model_path: str) -> dict[str, Any]:
    """SHA-256 of the model directory's :data:`MODEL_FILES` when ``model_path`` (what the server reports) is a
    directory this worker can read; otherwise only the path, and why (a hub id, or a path only the server's
    container sees: then the server's ``model_path``, ``revision`` and ``weight_version`` are what is known)."""
    if not model_path or not os.path.isdir(model_path):
        return {
            "path": model_path,
            "read": False,
            "files": {},
            "why": "not a directory this worker can read: the server's model_path, revision and weight_version "
            "are what is known of the weights",
        }
    files: dict[str, str] = {}
    for name in MODEL_FILES:
        try:
            with open(os.path.join(model_path, name), "rb") as f:
                files[name] = "sha256:" + hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            continue
        except OSError as exc:
            files[name] = f"unreadable: {exc}"
    return {"path": model_path, "read": True, "files": files}
