"""What a submit is asked to do (:class:`SubmitOptions`, one :class:`DatasetOptions` per input) and how it refuses
(:class:`SubmitError`).

Apart from :mod:`producer.submit` because every step of a submit reads these and raises that error (opening the
inputs, resolving the sampling, collecting the rendered prompts, writing the job record: each its own module), and
the job file (:mod:`producer.jobfile`) builds them without importing the submit itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.inputs import Columns


class SubmitError(Exception):
    """The submit cannot proceed; the message says what to do. Nothing was enqueued."""


@dataclass(frozen=True)
class DatasetOptions:
    """One input of a submit: a job file's ``datasets:`` entry (the PATH form makes one per PATH).
    ``None`` (and an empty ``sampling``) = the job's value in :class:`SubmitOptions`."""

    path: str  # a local path, s3://bucket/key, or a Hugging Face dataset id (local cache)
    name: str | None = None
    columns: Columns | None = None
    split: str | None = None
    samples: int | None = None
    #: this dataset's sampling overrides, keyed as the sampling flags are (max_new_tokens, …, seed)
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmitOptions:
    paths: list[Path]
    job: str
    tokenizer: str
    dataset_names: list[str] = field(default_factory=list)
    columns: Columns = field(default_factory=Columns)
    split: str | None = None
    samples: int = 1
    trust_remote_code: bool = False
    #: Merged over the model profile's thinking switch (Kimi ``{"thinking": true}``, Qwen3
    #: ``{"enable_thinking": true}``, …); the merged kwargs are what the job record keeps.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``--model-family`` (thinkfleet.profiles.FAMILIES); None = detected from the tokenizer.
    model_family: str | None = None
    #: False (``--no-reasoning-spans``): run although the tokenizer lacks the profile's reasoning markers;
    #: rows get empty reasoning spans and the reasoning alarm is off.
    reasoning_spans: bool = True
    #: ``--turns``: "last" regenerates the final assistant turn; "all" every turn, chained by the workers
    #: (turn 0 of each conversation is enqueued here as ``{prompt_id}/t0``; :mod:`thinkfleet.turns`).
    turns: str = "last"
    #: ``--tool-results`` (job file ``tool_results``; with ``--turns all``): "replay" regenerates through tool
    #: calls, feeding back the dataset's recorded results (thinkfleet/tool_steps.py); None = cut at the first tool.
    tool_results: str | None = None
    #: ``tool_mismatch``: "chain_end" (a call unlike the dataset's ends the chain) or "keep_recorded".
    tool_mismatch: str = "chain_end"
    #: ``max_tool_steps``: tool-calling answers fed back per turn at most.
    max_tool_steps: int = 8
    #: ``--tool-executor`` (``tool_results: executor``): ``module:function``, ``file.py:function`` or an http(s)
    #: URL, run by the workers that store the steps (workers/tool_exec.py; they must trust it).
    tool_executor: str | None = None
    think_start_id: int | None = None
    think_end_id: int | None = None
    max_prompt_tokens: int | None = None
    #: the served context length (``--context-length``); None = from the model's config.json, if any.
    context_length: int | None = None
    #: sampling flags as given on the command line; None = not given (the job's value, or the default).
    sampling: dict[str, Any] = field(default_factory=dict)
    #: ``--logprobs K``: rows store logprobs (top K alternatives); None = the job's (a new job: none).
    logprobs: int | None = None
    expected_model: str | None = None
    skip_invalid: bool = False
    dry_run: bool = False
    processes: int | None = None
    hosts: int = 1
    server_tok_s: float = 860.0
    mean_output_tokens: float = 1416.0
    #: the inputs one by one (a job file's ``datasets``); empty = ``paths`` with the shared flags.
    datasets: list[DatasetOptions] = field(default_factory=list)
    #: the job file, resolved (names and defaults filled, flags applied): kept in the job record.
    job_file: dict[str, Any] | None = None
    #: the job file's ``priority`` (kept in the job record); None = the job's, else 0.
    priority: int | None = None

    def inputs(self) -> list[DatasetOptions]:
        """Every input with its own options: ``datasets``, else one per PATH."""
        if self.datasets:
            return list(self.datasets)
        return [
            DatasetOptions(str(p), self.dataset_names[i] if self.dataset_names else None)
            for i, p in enumerate(self.paths)
        ]
