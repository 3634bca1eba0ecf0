"""A tiny random-weight model for the real-SGLang test tier, around one of our test tokenizers.

Run by the real-SGLang venv's Python (it has torch and transformers; thinkfleet's venv has neither):

    python scripts/real_sglang/make_model.py --tokenizer TOKDIR --out MODELDIR [--arch qwen2|qwen3]

The vocabulary is the tokenizer's family's real one (Kimi's 163,840 rows, Qwen3's 151,936), so the ids the
worker checks against the model's vocab, and the special ids it reads spans from, are the real family's. The
weights come from a fixed seed: the same command builds the same model, and greedy decoding on it is
deterministic. Hidden size 64 and 2 layers keep it at ~10 M parameters (the embedding, tied to the head).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def build(tokenizer: Path, out: Path, arch: str, vocab_size: int | None, seed: int) -> Path:
    gen_path = tokenizer / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    tok = json.loads((tokenizer / "tokenizer.json").read_text())
    ids = [t["id"] for t in tok.get("added_tokens", [])] + list(tok["model"]["vocab"].values())
    vocab = vocab_size or max(ids) + 1
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=gen.get("bos_token_id"),
        eos_token_id=gen.get("eos_token_id"),
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    # Our tokenizers are written by transformers 5 ("TokenizersBackend"); SGLang 0.5.9 runs 4.57, which loads
    # the same tokenizer.json as a PreTrainedTokenizerFast.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2))
    (out / ".complete").write_text(json.dumps({"arch": arch, "vocab_size": vocab, "seed": seed}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a test tokenizer directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=("qwen2", "qwen3"), default="qwen2")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's highest id + 1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.tokenizer, args.out, args.arch, args.vocab_size, args.seed))


if __name__ == "__main__":
    main()
