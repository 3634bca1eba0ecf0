"""A tiny random-weight model for the real-SGLang test tier, around one of our test tokenizers.

Run by the real-SGLang venv's Python (it has torch and transformers; thinkfleet's venv has neither):

    python scripts/real_sglang/make_model.py --tokenizer TOKDIR --out MODELDIR [--arch qwen2|qwen3|qwen2vl]

The vocabulary is the tokenizer's family's real one (Kimi's 163,840 rows, Qwen3's 151,936), so the ids the
worker checks against the model's vocab, and the special ids it reads spans from, are the real family's. The
weights come from a fixed seed: the same command builds the same model, and greedy decoding on it is
deterministic. Hidden size 64 and 2 layers keep it at ~10 M parameters (the embedding, tied to the head).

``qwen2vl`` is a vision model (``Qwen2VLForConditionalGeneration``, run by the vision overlay's Python:
``scripts/real_sglang.sh model TOKDIR OUT qwen2vl``) around a Qwen tokenizer that has the vision ids
(``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655, ``<|vision_end|>`` 151653, ``<|video_pad|>`` 151656): a
one-block vision tower of width 32, and a ``preprocessor_config.json`` of its own (Qwen2-VL's image processor,
patch 14, merge 2) whose pixel bounds keep every image between 4 and 64 tokens, so a CPU server encodes it in
milliseconds. The directory is checked by loading it as the server will (``AutoProcessor``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
#: The Qwen-VL vision tokens the tokenizer must have (the ids Qwen2VLConfig defaults to).
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
#: Qwen2-VL's image processor with small pixel bounds: 28 px merged patches, 4 to 64 of them an image.
PATCH, MERGE = 14, 2
QWEN2VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "merge_size": MERGE,
    "min_pixels": 4 * (PATCH * MERGE) ** 2,
    "max_pixels": 64 * (PATCH * MERGE) ** 2,
    "size": {"shortest_edge": 4 * (PATCH * MERGE) ** 2, "longest_edge": 64 * (PATCH * MERGE) ** 2},
}


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
    elif arch == "qwen2vl":
        config = qwen2vl_config(tok, common)
        model_cls = transformers.Qwen2VLForConditionalGeneration
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
    if arch == "qwen2vl":
        # Flat, as released Qwen2-VL checkpoints are: transformers 4.57 writes a text_config holding
        # ``model_type: qwen2_vl_text`` (which its Qwen2VLConfig then reports as the model's type, and SGLang's
        # M-RoPE refuses: "Unimplemented model type") and ``architectures`` (SGLang reads the top-level key).
        model_config = json.loads((out / "config.json").read_text())
        text_config = model_config.pop("text_config", {})
        for key in ("model_type", "architectures"):
            text_config.pop(key, None)
        model_config = {**text_config, **model_config, "architectures": [model_cls.__name__]}
        (out / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
        (out / "preprocessor_config.json").write_text(json.dumps(QWEN2VL_PREPROCESSOR, indent=2) + "\n")
        check_processor(out)
    (out / ".complete").write_text(json.dumps({"arch": arch, "vocab_size": vocab, "seed": seed}))
    return out


def qwen2vl_config(tok: dict, common: dict) -> transformers.PretrainedConfig:
    """A tiny Qwen2-VL: the text model of ``common`` with M-RoPE, a one-block vision tower, the tokenizer's ids."""
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    missing = [token for token in VISION_TOKENS.values() if token not in specials]
    if missing:
        raise SystemExit(f"the tokenizer has no {missing}: a Qwen2-VL model needs a Qwen tokenizer with vision tokens")
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    vision = dict(
        depth=1,
        embed_dim=32,
        num_heads=2,
        mlp_ratio=2,
        hidden_size=common["hidden_size"],  # the merger's output: the text model's width
        in_channels=3,
        in_chans=3,  # SGLang's Qwen2VisionTransformer reads the original checkpoints' spelling
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    # M-RoPE splits each head's rotary half (head_dim / 2 frequencies) into temporal, height and width sections.
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    return transformers.Qwen2VLConfig(
        vision_config=vision,
        rope_scaling={"type": "mrope", "mrope_section": section},
        **{key: specials[token] for key, token in VISION_TOKENS.items()},
        **common,
    )


def check_processor(out: Path) -> None:
    """Load ``out`` as SGLang's tokenizer manager will (AutoProcessor: tokenizer, image and video processors) and
    expand one placeholder: a directory the server cannot use fails here, naming why."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(out)
    text = "a<|vision_start|><|image_pad|><|vision_end|>b"
    got = processor(text=[text], images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((got["input_ids"][0] == pad).sum()) == 4, got["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a test tokenizer directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=("qwen2", "qwen3", "qwen2vl"), default="qwen2")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's highest id + 1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.tokenizer, args.out, args.arch, args.vocab_size, args.seed))


if __name__ == "__main__":
    main()
