"""How many tokens an image becomes on the server (thinkfleet/vision.py), checked against the processors' own
source and published figures, and how a message carries image references: bound into its content hash, refused
when a producer did not write them."""

from __future__ import annotations

import ast
import importlib.util
import math
import random
from pathlib import Path
from typing import Any

import pytest

from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir, layout
from thinkfleet.message import MessageRefused, PromptTask, content_hash, pack_ids
from thinkfleet.vision import (
    KIMI,
    QWEN,
    ImageRef,
    VisionError,
    image_rule,
    kimi_image_tokens,
    placeholder,
    qwen_image_tokens,
    smart_resize,
)

SHA = "ab" * 32


# -- Kimi-K2.5: navit_resize_image ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "tokens"),
    # tinker-cookbook's kimi_k25_test.py, from the HF image processor of the released checkpoint
    [((2048, 1365), 3626), ((17, 64), 3), ((5000, 6000), 4189)],
)
def test_kimi_token_counts_match_the_released_processor(size: tuple[int, int], tokens: int) -> None:
    assert kimi_image_tokens(*size) == tokens
    rule = image_rule(layout("kimi").preprocessor or {}, "kimi/preprocessor_config.json")
    assert rule.kind == KIMI and rule.tokens(*size) == tokens


def test_kimi_images_are_capped_near_4k_tokens() -> None:
    # in_patch_limit 16384 patches of 14 px, merged 2×2: at most 4096 tokens before padding rounds up
    worst = max(kimi_image_tokens(w, h) for w in range(1000, 12000, 997) for h in range(1000, 12000, 1009))
    assert 4096 <= worst <= 4300


# -- Qwen-VL: transformers' smart_resize -----------------------------------------------------------------------
def _transformers_smart_resize() -> Any:
    """``smart_resize`` compiled from the installed transformers' own source (the module imports torch, which this
    environment lacks: only the function is taken)."""
    root = importlib.util.find_spec("transformers").submodule_search_locations[0]  # type: ignore[union-attr]
    source = Path(root, "models", "qwen2_vl", "image_processing_qwen2_vl.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module([node], []), "smart_resize", "exec"), namespace)  # the library's own code
    return namespace["smart_resize"]


def test_smart_resize_is_the_transformers_rule() -> None:
    theirs = _transformers_smart_resize()
    rng = random.Random(7)
    for _ in range(3000):
        w, h = rng.randint(1, 6000), rng.randint(1, 6000)
        if max(w, h) / min(w, h) > 200:
            continue
        for factor, lo, hi in ((28, 56 * 56, 28 * 28 * 1280), (32, 65536, 16777216)):
            assert smart_resize(h, w, factor, lo, hi) == theirs(h, w, factor, lo, hi), (w, h, factor)


def test_qwen3_vl_counts_and_config_keys() -> None:
    # Qwen3-VL: patch 16 × merge 2; 224×224 → 64 tokens (tinker-cookbook image_token_count_test.py)
    rule = image_rule(layout("qwen3").preprocessor or {}, "qwen3/preprocessor_config.json")
    assert rule.kind == QWEN and rule.tokens(224, 224) == 64
    assert qwen_image_tokens(224, 224, 16, 2, 65536, 16777216) == 64
    # Qwen2-VL's older file: top-level min_pixels/max_pixels override size (transformers' backward compatibility)
    old = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
           "min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}  # fmt: skip
    assert image_rule(old, "x").params["min_pixels"] == 3136 and image_rule(old, "x").tokens(56, 56) == 4
    with pytest.raises(VisionError, match="elongated"):
        rule.tokens(10_000, 10)


def test_an_unknown_or_broken_processor_config_is_refused_naming_the_file() -> None:
    with pytest.raises(VisionError, match=r"m/preprocessor_config.json: an image processor .*no token-count rule"):
        image_rule({"image_processor_type": "SiglipImageProcessor"}, "m/preprocessor_config.json")
    with pytest.raises(VisionError, match="patch_size is 0"):
        image_rule({"media_proc_cfg": {"patch_size": 0}}, "k/preprocessor_config.json")


def test_test_tokenizers_hold_the_placeholder_ids() -> None:
    from transformers import AutoTokenizer

    kimi = AutoTokenizer.from_pretrained(str(build_test_tokenizer(default_test_tokenizer_dir())))
    for token, token_id in {"<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                            "<|media_pad|>": 163605}.items():  # fmt: skip
        assert kimi.convert_tokens_to_ids(token) == token_id
    qwen = AutoTokenizer.from_pretrained(str(build_test_tokenizer(default_test_tokenizer_dir(family="qwen3"))))
    for token, token_id in {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655}.items():
        assert qwen.convert_tokens_to_ids(token) == token_id
    rule = image_rule(layout("kimi").preprocessor or {}, "x")
    assert placeholder(kimi, rule, "kimi").token_id == 163605
    with pytest.raises(VisionError, match=r"has no <\|media_pad\|> token"):
        placeholder(qwen, rule, "qwen3")


# -- the message -----------------------------------------------------------------------------------------------
def _ref(position: int, sha: str = SHA, **kw: Any) -> ImageRef:
    values = {"sha256": sha, "uri": f"/store/{sha[:2]}/{sha}.png", "mime": "image/png", "width": 64, "height": 48,
              "tokens": 12, "position": position, **kw}  # fmt: skip
    return ImageRef(**values)


def test_image_references_ride_as_the_13th_argument_and_bind_the_content_hash() -> None:
    ids = [5, 163605, 7, 163605, 9]
    media = (_ref(1), _ref(3, "cd" * 32))
    task = PromptTask("j", "d", "d/1", 0, content_hash(ids, [m.sha256 for m in media]), pack_ids(ids), media=media)
    args = task.to_args()
    assert len(args) == 13 and args[9:12] == ["", "", None]
    again = PromptTask.from_args(args)
    assert again == task and again.verified_ids() == ids
    # a text prompt's message is as short as before, and its hash is the ids' alone
    text = PromptTask("j", "d", "d/2", 0, content_hash(ids), pack_ids(ids))
    assert len(text.to_args()) == 9 and content_hash(ids) != task.content_hash
    # the images stripped or swapped no longer hash to what was submitted (and signed: the hash is in the signature)
    with pytest.raises(MessageRefused, match="content_hash_mismatch: the ids hash to"):
        PromptTask.from_args(args[:9]).verified_ids()
    swapped = PromptTask.from_args([*args[:9], "", "", None, [_ref(1, "cd" * 32).to_wire(), _ref(3, SHA).to_wire()]])
    with pytest.raises(MessageRefused, match="content_hash_mismatch: the ids and images hash"):
        swapped.verified_ids()


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        ([], "media must be a list"),
        ([{"sha256": "XYZ"}], "sha256"),
        ([_ref(1).to_wire() | {"uri": ""}], "uri"),
        ([_ref(1).to_wire() | {"mime": "text/html"}], "mime"),
        ([_ref(1).to_wire() | {"tokens": 0}], "positive"),
        ([_ref(3).to_wire(), _ref(1).to_wire()], "do not increase"),
    ],
)
def test_media_a_producer_did_not_write_is_refused(wire: list[Any], error: str) -> None:
    args = PromptTask("j", "d", "d/1", 0, "0" * 16, pack_ids([1, 2])).to_args()
    with pytest.raises(ValueError, match=error):
        PromptTask.from_args([*args, "", "", None, wire])


def test_a_placeholder_position_past_the_ids_is_a_corrupt_message() -> None:
    ids = [1, 2, 3]
    media = (_ref(7),)
    task = PromptTask("j", "d", "d/1", 0, content_hash(ids, [SHA]), pack_ids(ids), media=media)
    with pytest.raises(MessageRefused, match="corrupt_message: image placeholder position 7"):
        task.verified_ids()


# -- the demo Kimi template's image run ------------------------------------------------------------------------
def test_the_kimi_templates_newline_after_an_image_leaves_text_prompts_ids_unchanged() -> None:
    from demo.families import CHAT_TEMPLATE
    from thinkfleet.template import load_tokenizer

    tok = load_tokenizer(str(build_test_tokenizer(default_test_tokenizer_dir())))
    before = CHAT_TEMPLATE.replace("<|media_end|>{{ '\\n' }}", "<|media_end|>")  # the template before the fix
    assert before != CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    conversations = [
        ([{"role": "user", "content": "What is 2+2?"}], None, {}),
        ([{"role": "system", "content": "Terse."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         tools, {"thinking": False}),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
          {"role": "user", "content": "c"}], None, {"thinking": True}),
    ]  # fmt: skip

    def ids(template: str, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> list[int]:
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, chat_template=template, **kwargs
        )
        return tok(text, add_special_tokens=False)["input_ids"]

    for messages, tools_, kwargs in conversations:
        assert ids(CHAT_TEMPLATE, messages, tools_, kwargs) == ids(before, messages, tools_, kwargs)
    image = [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": "What?"}]}]
    now = ids(CHAT_TEMPLATE, image, None, {})
    assert tok.decode(now).count("<|media_end|>\nWhat?") == 1
    assert tok.decode(ids(before, image, None, {})).count("<|media_end|>What?") == 1


def test_a_signed_image_message_binds_its_images_through_the_content_hash() -> None:
    from thinkfleet.signing import Signer

    signer = Signer(b"k" * 40)
    ids = [5, 163605, 7]
    media = (_ref(1),)
    signed = signer.sign_task(
        PromptTask("j", "d", "d/1", 0, content_hash(ids, [SHA]), pack_ids(ids), generation="g1", media=media)
    )
    again = PromptTask.from_args(signed.to_args())
    signer.check_task(again)  # the signature travels with the images
    assert again.media == media and again.verified_ids() == ids
    # another image in the same message keeps a valid signature but no longer matches the signed hash
    forged = PromptTask.from_args([*signed.to_args()[:12], [_ref(1, "cd" * 32).to_wire()]])
    signer.check_task(forged)
    with pytest.raises(MessageRefused, match="content_hash_mismatch"):
        forged.verified_ids()
