"""Every consumer thinkfleet's exports name, run on the export meant for it; what each one would train on, as JSON.

Run by the consumers' venv (``bash scripts/consumers.sh env`` prints its python), not by thinkfleet's, which has
neither torch nor the trainers. One process runs every check, so the imports are paid once:

    python scripts/consumers/check.py SPEC.json RESULT.json

SPEC names the exports and the tokenizer (keys below); RESULT gets, per consumer, the rows as the consumer holds
them when it is about to train — token ids and which of them carry loss — and the consumers' own default length
limits. Nothing here judges: tests/test_consumers.py compares the rows with the stored ones, token by token.

- ``specforge`` (JSONL): SpecForge 0.2.0's pre-tokenized prompt builder (``data.prompts_path``) and speculators
  0.9.0's ``prepare-data --data`` (its own CLI app, run in this process);
- ``conversations``: SpecForge's text route (``data.train_data_path``, its ``kimi-k2-thinking`` template), and
  what speculators (without a render endpoint) and TRL do with it;
- ``hf`` (and ``hf_exclude_reasoning``): ``datasets.load_from_disk``, then TRL 1.16's ``SFTTrainer`` with its
  default ``SFTConfig`` — the dataset preparation builds the labels, the trainer's own collator pads a batch;
- ``messages``: TRL on the records as they are, with ``assistant_only_loss=True``, and mapped to prompt/completion;
- ``eagle3_parquet``: handed to SpecForge's prompt builder (which reads JSONL).

The model is a tiny random-weight Qwen2 around the test tokenizer (its vocabulary, 16 hidden units, one layer):
the trainer needs a model to be built, and one forward pass proves a batch is what a model takes.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

#: The only settings given to TRL beyond its defaults: where it would write, no experiment tracker, and the CPU
#: (its default bf16 refuses to start on a machine without a GPU unless told to use the CPU).
TRL_MACHINE_SETTINGS: dict[str, Any] = {"report_to": "none", "use_cpu": True}


def defaults(work: Path) -> dict[str, int]:
    """The length limits each consumer applies when its user sets none (rows past them are cut or dropped)."""
    from specforge.config.schema import DataConfig
    from speculators.cli.prepare_data import prepare_data
    from trl import SFTConfig

    trl = SFTConfig(output_dir=str(work / "trl-defaults"), **TRL_MACHINE_SETTINGS)
    return {
        "trl_max_length": trl.max_length,
        "specforge_max_length": DataConfig.model_fields["max_length"].default,
        "speculators_seq_length": inspect.signature(prepare_data).parameters["seq_length"].default,
    }


def longest_row(path: str) -> int:
    """The longest record of a token JSONL: the length limit each consumer is given (nothing cut)."""
    with open(path) as lines:
        return max(len(json.loads(line)["input_ids"]) for line in lines)


def specforge_rows(path: str) -> list[dict[str, Any]]:
    from specforge.config.schema import DataConfig
    from specforge.data.prompt_builder import prepare_prompt_tasks

    longest = longest_row(path)
    DataConfig(prompts_path=path, max_length=longest)  # the config a run would carry
    tasks = prepare_prompt_tasks(path, None, chat_template=None, max_length=longest, is_preformatted=False,
                                 train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)  # fmt: skip
    return [{"input_ids": t["payload"]["input_ids"], "loss_mask": t["payload"]["loss_mask"]} for t in tasks]


def speculators_rows(path: str, tok_dir: str, work: Path) -> list[dict[str, Any]]:
    """speculators' ``prepare-data`` command, parsed and run by its own CLI app (in this process: a second one
    would import torch again, ~20 s on a loaded box)."""
    from datasets import load_from_disk
    from speculators.cli import app  # the `speculators` console script
    from typer.testing import CliRunner

    args = ["prepare-data", "--model", tok_dir, "--data", path, "--output", str(work / "speculators")]
    args += ["--seq-length", str(longest_row(path)), "--num-preprocessing-workers", "1"]
    done = CliRunner().invoke(app, args)
    if done.exit_code != 0:
        output = done.output[-3000:]
        raise RuntimeError(f"speculators prepare-data failed (exit {done.exit_code}): {output}") from done.exception
    prepared = load_from_disk(str(work / "speculators"))
    return [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in prepared]


def specforge_text_route(path: str, tok: Any, max_length: int) -> list[dict[str, Any]]:
    """SpecForge's ``data.train_data_path`` on the conversations export: re-rendered and re-tokenized."""
    from specforge.data.prompt_builder import prepare_prompt_tasks

    tasks = prepare_prompt_tasks(path, tok, chat_template="kimi-k2-thinking", max_length=max_length,
                                 is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=1)  # fmt: skip
    return [{"input_ids": t["payload"]["input_ids"], "loss_mask": t["payload"]["loss_mask"]} for t in tasks]


def specforge_on_parquet(path: str) -> str:
    """What SpecForge's prompt builder does with the eagle3 Parquet: the error it raises, or "read"."""
    from specforge.data.prompt_builder import prepare_prompt_tasks

    try:
        prepare_prompt_tasks(path, None, chat_template=None, max_length=1 << 20, is_preformatted=False,
                             train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)  # fmt: skip
    except Exception as exc:  # whatever it raises is the finding
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "read"


def conversations_elsewhere(path: str, tok_dir: str, model: Any, tok: Any, work: Path) -> dict[str, str]:
    """What speculators (no render endpoint) and TRL do with the conversations export: the error, or "read"."""
    from datasets import load_dataset
    from speculators.cli import app
    from typer.testing import CliRunner

    args = ["prepare-data", "--model", tok_dir, "--data", path, "--output", str(work / "speculators-conversations")]
    done = CliRunner().invoke(app, [*args, "--num-preprocessing-workers", "1"])
    found = {"speculators": "read" if done.exit_code == 0 else f"{type(done.exception).__name__}: {done.exception}"}
    dataset = load_dataset("json", data_files=path, split="train", cache_dir=str(work / "hf-cache"))
    try:
        trl_prepared(dataset, model, tok, work / "conversations")
        found["trl"] = "read"
    except Exception as exc:  # whatever it raises is the finding
        found["trl"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return found


def tiny_model(tok: Any) -> Any:
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=max(tok.get_vocab().values()) + 1, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 15, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def trl_prepared(dataset: Any, model: Any, tok: Any, work: Path, **settings: Any) -> tuple[Any, Any]:
    """TRL's SFTTrainer built as a user would (defaults + ``settings``): its prepared dataset and the trainer."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(work / "trl"), **TRL_MACHINE_SETTINGS, **settings)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
    return trainer.train_dataset, trainer


def trained_rows(prepared: Any, trainer: Any, forward: bool = False) -> dict[str, dict[str, Any]]:
    """id → the row as TRL's own collator batches it: ``input_ids`` and ``labels`` (-100: no loss), unpadded.

    ``forward``: also one forward pass of the shortest row through the model (a finite loss: a batch it takes)."""
    import torch

    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in prepared]
    batch = trainer.data_collator(rows)
    out: dict[str, dict[str, Any]] = {}
    for i, pid in enumerate(prepared["id"]):
        keep = batch["attention_mask"][i].bool()
        out[pid] = {"input_ids": batch["input_ids"][i][keep].tolist(), "labels": batch["labels"][i][keep].tolist()}
    if forward and rows:
        shortest = min(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
        one = trainer.data_collator([rows[shortest]])
        with torch.no_grad():
            loss = trainer.model(**one).loss.item()
        if not math.isfinite(loss):
            raise RuntimeError(f"the forward pass gave a loss of {loss}")
    return out


def trl_on_hf(path: str, model: Any, tok: Any, work: Path) -> dict[str, Any]:
    from datasets import load_from_disk

    dataset = load_from_disk(path)
    loaded = {r["id"]: {k: r.get(k) for k in ("input_ids", "assistant_masks", "loss_mask")} for r in dataset}
    prepared, trainer = trl_prepared(dataset, model, tok, work / Path(path).name)
    return {"loaded": loaded, "columns": dataset.column_names, "trl": trained_rows(prepared, trainer, forward=True)}


def trl_on_messages(path: str, model: Any, tok: Any, work: Path) -> dict[str, Any]:
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=path, split="train", cache_dir=str(work / "hf-cache"))
    prepared, trainer = trl_prepared(dataset, model, tok, work / "messages")
    as_is = trained_rows(prepared, trainer)
    try:
        trl_prepared(dataset, model, tok, work / "messages-aol", assistant_only_loss=True)
        assistant_only = "accepted"
    except Exception as exc:  # whatever it raises is the finding
        assistant_only = f"{type(exc).__name__}: {str(exc)[:300]}"
    # The route TRL documents for training on the answer only: prompt/completion records (completion_only_loss is
    # then on by default).
    pairs = dataset.map(
        lambda r: {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]}, remove_columns=["messages"]
    )
    prepared, trainer = trl_prepared(pairs, model, tok, work / "messages-pc")
    return {"as_is": as_is, "assistant_only_loss": assistant_only, "prompt_completion": trained_rows(prepared, trainer)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    work = Path(spec["work"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    model = tiny_model(tok)
    longest = longest_row(spec["specforge"])
    result = {
        "defaults": defaults(work),
        "specforge": specforge_rows(spec["specforge"]),
        "speculators": speculators_rows(spec["specforge"], spec["tokenizer"], work),
        "specforge_text_route": specforge_text_route(spec["conversations"], tok, 4 * longest),
        "specforge_on_eagle3_parquet": specforge_on_parquet(spec["eagle3_parquet"]),
        "conversations_elsewhere": conversations_elsewhere(spec["conversations"], spec["tokenizer"], model, tok, work),
        "hf": trl_on_hf(spec["hf"], model, tok, work),
        "hf_exclude_reasoning": trl_on_hf(spec["hf_exclude_reasoning"], model, tok, work),
        "messages": trl_on_messages(spec["messages"], model, tok, work),
    }
    # speculators hands back torch tensors: plain lists in the JSON
    Path(sys.argv[2]).write_text(json.dumps(result, default=lambda value: value.tolist()))


if __name__ == "__main__":
    main()
