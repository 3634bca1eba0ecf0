"""A submit's inputs: each dataset opened with the options its rows get (:class:`Input`), and read lazily into the
render pool (:class:`Feed`).

Apart from :mod:`producer.inputs` (a dataset's rows → conversations, whoever reads them) because this is the
submit's side of reading: dataset names unique across the inputs, a job file's per-dataset options, and with
``--turns all`` each conversation cut to its first turn, its plan kept for the workers.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from producer.inputs import Columns, Dataset, InputError, Problem, Prompt, iter_prompts, open_dataset
from producer.submit_options import DatasetOptions, SubmitError, SubmitOptions
from thinkfleet.settings import Settings
from thinkfleet.vision import image_count


@dataclass
class Input:
    """An opened dataset and what its rows get: the job's options, or its own (:class:`DatasetOptions`)."""

    dataset: Dataset
    options: DatasetOptions
    columns: Columns
    split: str | None
    samples: int = 1  # resolved by jobrecord.resolve_dataset_sampling (a re-submit keeps the job's value)
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling_params keys that differ from the job's
    params: dict[str, Any] = field(default_factory=dict)  # the job's sampling_params ← overrides
    budget: int = 0  # the largest max_new_tokens any sample of a row gets


def open_inputs(opts: SubmitOptions, settings: Settings) -> list[Input]:
    """Every input opened, before any rendering (a bad path or dataset fails here); names must differ."""
    inputs: list[Input] = []
    names: dict[str, str] = {}
    for d in opts.inputs():
        split = d.split if d.split is not None else opts.split
        try:
            ds = open_dataset(d.path, d.name, settings.s3_endpoint_url, split)
        except InputError as e:
            raise SubmitError(str(e)) from e
        if ds.name in names:
            raise SubmitError(
                f"{d.path}: dataset name {ds.name!r} is also {names[ds.name]}; give each a --dataset-name "
                "(job file: name)"
            )
        names[ds.name] = d.path
        inputs.append(Input(ds, d, d.columns or opts.columns, split))
    return inputs


class Feed:
    """The inputs, read lazily by the render pool's task thread while earlier batches render.

    Each prompt is remembered in ``pending`` as it is handed out; results come back in the same order.
    A file-level error stops the feed and is re-raised by the caller once rendering has drained.
    """

    def __init__(self, opts: SubmitOptions, inputs: list[Input], problems: list[Problem]) -> None:
        self.opts, self.inputs, self.problems = opts, inputs, problems
        self.pending: collections.deque[tuple[str, Prompt]] = collections.deque()
        self.error: Exception | None = None
        #: --turns all: conversation id → its turns (thinkfleet.turns.plan_conversation) and source
        self.conversations: dict[str, dict[str, Any]] = {}
        self.cut_at_tool = 0

    def __iter__(self) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
        try:
            for inp in self.inputs:
                for prompt in iter_prompts(inp.dataset, inp.columns, inp.split, self.problems):
                    if self.opts.turns == "all":
                        prompt = self._first_turn(inp.dataset.name, prompt)
                    self.pending.append((inp.dataset.name, prompt))
                    yield prompt.messages, prompt.tools
        except Exception as e:  # raised in the pool's thread: hand it to the caller instead
            self.error = e

    def _first_turn(self, dataset: str, prompt: Prompt) -> Prompt:
        """--turns all: the conversation's turn 0 (history up to its first user message), ``{id}/t0``."""
        from thinkfleet.tool_steps import plan_agentic
        from thinkfleet.turns import plan_conversation, turn_id

        # An agentic job (tool_results set) keeps the recorded calls and results: nothing is cut at a tool call.
        agentic = self.opts.tool_results is not None
        plan = plan_agentic(prompt.messages) if agentic else plan_conversation(prompt.messages)
        if plan is None:  # no user turn: rendered as it is (one turn), as --turns last would
            plan = {"messages": prompt.messages, "users": [len(prompt.messages) - 1], "turn_count": 1,
                    "cut_at_tool": False}  # fmt: skip
        self.cut_at_tool += int(plan["cut_at_tool"])
        plan.update(dataset=dataset, row_index=prompt.row_index, tools=prompt.tools)
        self.conversations[prompt.prompt_id] = plan
        first = plan["messages"][: plan["users"][0] + 1]
        images = prompt.images
        if images:
            # Every image of the conversation, in order: the workers give each later turn the first ones its history
            # holds (workers/turns.py); turn 0 carries those of its own messages.
            plan["images"] = [ref.to_wire() for ref in images]
            images = images[: image_count(first)]
        return dataclasses.replace(prompt, prompt_id=turn_id(prompt.prompt_id, 0), messages=first, images=images)

    def take(self, n: int) -> list[tuple[str, Prompt]]:
        return [self.pending.popleft() for _ in range(n)]
