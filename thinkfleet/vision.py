"""Images in a prompt: what one placeholder is, how many tokens the server expands it into, and how a message
refers to an image (:class:`ImageRef`) without carrying its bytes.

SGLang's ``/generate`` takes ``input_ids`` with exactly **one** placeholder per image, as the chat template renders
it, plus ``image_data`` (one entry per placeholder, in order); the server expands each placeholder into as many
tokens as the model's image processor makes of that image (docs/vision.md). The producer needs the count to budget
the context (an image costs up to ~4.2k Kimi-K2.5 tokens); the worker and the simulator will need it to check the
server's ``prompt_tokens`` (issue 33 parts 3 and 5). Each rule here is the processor's own arithmetic, with its
sizes read from the model directory's ``preprocessor_config.json``:

- **Kimi-K2.5** (``media_proc_cfg``; the checkpoint's remote-code ``media_utils.navit_resize_image``): scale the
  image down so that it holds at most ``in_patch_limit`` patches of ``patch_size`` px and at most
  ``patch_limit_on_one_side`` patches a side, pad it to a multiple of ``patch_size × merge_kernel_size``, one token
  per merged ``merge_kernel_size²`` patches: 2048×1365 → 3,626, 5000×6000 → 4,189, 17×64 → 3.
- **Qwen2-VL / Qwen2.5-VL / Qwen3-VL** (transformers ``image_processing_qwen2_vl.smart_resize``): round each side
  to a multiple of ``patch_size × merge_size`` keeping the pixels within ``[min_pixels, max_pixels]``, one token
  per ``merge_size²`` patches: Qwen3-VL (patch 16) 224×224 → 64.

Only the foundation's own modules are imported: the producer, the worker and the simulator all stand on this.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

#: Where the rules read their sizes (next to the tokenizer, in the model directory).
PREPROCESSOR_CONFIG = "preprocessor_config.json"
#: Kimi-K2.5's ``media_proc_cfg`` as released (the checkpoint's ``preprocessor_config.json``; SGLang's image-only
#: fallback processor carries the same defaults): used for a key the file leaves out.
KIMI_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 16384,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
}
#: transformers' Qwen2-VL image processor defaults (``Qwen2VLImageProcessor``: size shortest_edge 56×56,
#: longest_edge 28×28×1280, patch 14, merge 2), used for a key the file leaves out.
QWEN_DEFAULTS: dict[str, Any] = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
#: smart_resize refuses images more elongated than this (transformers raises ValueError; so does the server).
QWEN_MAX_ASPECT = 200

KIMI = "kimi-navit"
QWEN = "qwen-smart-resize"


class VisionError(ValueError):
    """A model directory, a tokenizer or an image that cannot be used for image prompts; the text says the fix."""


@dataclass(frozen=True)
class Placeholder:
    """The one token a chat template renders per image, and the text around it (what docs/vision.md shows)."""

    token: str  # "<|media_pad|>" (Kimi) / "<|image_pad|>" (Qwen-VL)
    token_id: int
    rendered: str  # the whole run the template renders for one image


#: Placeholder token → what the template renders around it.
PLACEHOLDERS = {
    "<|media_pad|>": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n",
    "<|image_pad|>": "<|vision_start|><|image_pad|><|vision_end|>",
}
#: Which placeholder each rule's models use.
RULE_PLACEHOLDER = {KIMI: "<|media_pad|>", QWEN: "<|image_pad|>"}


@dataclass(frozen=True)
class ImageRule:
    """How many tokens one image becomes on the server: ``kind`` (:data:`KIMI` / :data:`QWEN`) with its sizes."""

    kind: str
    params: dict[str, Any]
    source: str  # "…/preprocessor_config.json media_proc_cfg", for messages

    def tokens(self, width: int, height: int) -> int:
        """Tokens the server expands one ``width`` × ``height`` image into (raises :class:`VisionError` for an
        image the processor refuses)."""
        if width < 1 or height < 1:
            raise VisionError(f"an image of {width}×{height} px has no pixels")
        p = self.params
        if self.kind == KIMI:
            return kimi_image_tokens(
                width, height, p["patch_size"], p["merge_kernel_size"], p["in_patch_limit"],
                p["patch_limit_on_one_side"], p["fixed_output_tokens"],
            )  # fmt: skip
        return qwen_image_tokens(width, height, p["patch_size"], p["merge_size"], p["min_pixels"], p["max_pixels"])


def kimi_image_tokens(
    width: int,
    height: int,
    patch_size: int = 14,
    merge_kernel_size: int = 2,
    in_patch_limit: int = 16384,
    patch_limit_on_one_side: int = 512,
    fixed_output_tokens: int | None = None,
) -> int:
    """Kimi-K2.5's ``navit_resize_image(...)["num_tokens"]`` (what ``media_tokens_calculator`` returns)."""
    if fixed_output_tokens is not None:
        return int(fixed_output_tokens)
    s1 = math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    s2 = patch_limit_on_one_side * patch_size / width
    s3 = patch_limit_on_one_side * patch_size / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), patch_limit_on_one_side * patch_size)
    new_h = min(max(1, int(height * scale)), patch_limit_on_one_side * patch_size)
    factor = merge_kernel_size * patch_size
    return math.ceil(new_h / factor) * math.ceil(new_w / factor)  # padded up to whole merged patches


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize``: (height, width) after resizing."""
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise VisionError(
            f"an image of {width}×{height} px is more elongated than {QWEN_MAX_ASPECT}:1, which Qwen-VL's image "
            "processor refuses; crop or pad it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_image_tokens(
    width: int, height: int, patch_size: int = 14, merge_size: int = 2, min_pixels: int = 3136,
    max_pixels: int = 1003520,
) -> int:  # fmt: skip
    """Qwen-VL's image tokens: ``image_grid_thw.prod() // merge_size**2`` (one temporal patch for an image)."""
    h, w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return (h // patch_size) * (w // patch_size) // (merge_size * merge_size)


def image_rule(config: dict[str, Any], where: str) -> ImageRule:
    """The rule of a ``preprocessor_config.json`` (``where`` names the file): Kimi's ``media_proc_cfg``, or a
    Qwen-VL image processor (``patch_size`` + ``merge_size``); :class:`VisionError` for any other."""
    if isinstance(config.get("media_proc_cfg"), dict):
        cfg = {**KIMI_DEFAULTS, **{k: v for k, v in config["media_proc_cfg"].items() if k in KIMI_DEFAULTS}}
        merge = cfg["merge_kernel_size"]
        if isinstance(merge, list | tuple):  # some configs spell it [2, 2]
            if len(set(merge)) != 1:
                raise VisionError(f"{where}: media_proc_cfg.merge_kernel_size {merge} is not square")
            cfg["merge_kernel_size"] = merge[0]
        _positive(cfg, ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"), where)
        return ImageRule(KIMI, cfg, f"{where} media_proc_cfg")
    kind = str(config.get("image_processor_type") or config.get("processor_class") or "")
    if "merge_size" in config or re.search(r"Qwen\d?(_\d)?VL", kind.replace(".", "_"), re.IGNORECASE):
        cfg = dict(QWEN_DEFAULTS)
        cfg.update({k: config[k] for k in ("patch_size", "merge_size") if k in config})
        size = config.get("size") if isinstance(config.get("size"), dict) else {}
        # transformers ≥ 4.5x (and the fast processor of 4.57): size.shortest_edge / longest_edge, then the
        # top-level min_pixels / max_pixels override them (backward compatibility).
        cfg["min_pixels"] = config.get("min_pixels") or size.get("shortest_edge") or cfg["min_pixels"]
        cfg["max_pixels"] = config.get("max_pixels") or size.get("longest_edge") or cfg["max_pixels"]
        _positive(cfg, ("patch_size", "merge_size", "min_pixels", "max_pixels"), where)
        return ImageRule(QWEN, cfg, where)
    raise VisionError(
        f"{where}: an image processor this producer has no token-count rule for ({kind or 'no image_processor_type'}"
        "; known: Kimi-K2.5 media_proc_cfg, Qwen2-VL/2.5-VL/3-VL); image prompts of this model cannot be budgeted"
    )


def _positive(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise VisionError(f"{where}: {key} is {value!r}, not a positive integer; fix the file")


def placeholder(tok: Any, rule: ImageRule, where: str) -> Placeholder:
    """The rule's placeholder token as ``tok`` spells it: one special id, else :class:`VisionError` naming the
    tokenizer (a text-only tokenizer of the family, or another model's processor config)."""
    token = RULE_PLACEHOLDER[rule.kind]
    ids = tok.convert_tokens_to_ids([token])
    token_id = ids[0] if ids else None
    if not isinstance(token_id, int) or token_id == getattr(tok, "unk_token_id", None) or token_id < 0:
        raise VisionError(
            f"tokenizer {where!r} has no {token} token, which the image processor of {rule.source} needs (one per "
            "image): pass --tokenizer the vision model's own directory"
        )
    return Placeholder(token, token_id, PLACEHOLDERS[token])


# -- what a message carries of an image ------------------------------------------------------------------------
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: An image reference's URI at most (a store URI: ``s3://bucket/prefix/job/_images/ab/<sha256>.png``).
MAX_URI_CHARS = 2048
#: Images one message may carry (a bound a worker checks before reading any of them; producer submit refuses a row
#: with more). ~250 bytes of references each: 128 stay well inside the message size a worker decodes (its ids'
#: bytes + 64 KiB, thinkfleet/settings.py ``message_byte_limit``).
MAX_IMAGES_PER_PROMPT = 128


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt as a message and a row refer to it: its content address, where the store keeps its
    bytes (byte-identical to what the dataset gave), its size, the tokens the server expands its placeholder into
    and that placeholder's index in ``input_ids`` (-1 until the prompt is rendered)."""

    sha256: str
    uri: str
    mime: str  # "image/png", "image/jpeg", …: the data URI a worker builds from the bytes
    width: int
    height: int
    tokens: int
    position: int = -1

    def to_wire(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256, "uri": self.uri, "mime": self.mime, "width": self.width,
            "height": self.height, "tokens": self.tokens, "position": self.position,
        }  # fmt: skip

    @classmethod
    def from_wire(cls, value: Any) -> ImageRef:
        """An image reference from a message; ValueError for anything a producer did not write."""
        if not isinstance(value, dict):
            raise ValueError(f"an image reference is a map, got {type(value).__name__}")
        sha, uri, mime = value.get("sha256"), value.get("uri"), value.get("mime")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ValueError(f"image sha256 {str(sha)[:80]!r} is not 64 lowercase hex digits")
        if not isinstance(uri, str) or not uri or len(uri) > MAX_URI_CHARS:
            raise ValueError(f"image uri {str(uri)[:80]!r} is empty, not text, or over {MAX_URI_CHARS} characters")
        if not isinstance(mime, str) or not re.fullmatch(r"image/[a-z0-9.+-]{1,32}", mime):
            raise ValueError(f"image mime {str(mime)[:80]!r} is not image/<type>")
        numbers = [value.get(k) for k in ("width", "height", "tokens", "position")]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) or min(numbers[:3]) < 1:
            raise ValueError(f"image width/height/tokens/position {numbers} are not positive integers")
        return cls(sha, uri, mime, *numbers)  # type: ignore[arg-type]


def image_count(messages: list[dict[str, Any]]) -> int:
    """How many images a rendered conversation's messages hold (the producer's resolved ``{"type": "image",
    "image": <store URI>, "sha256": …}`` parts): the chat template renders one placeholder for each."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def expanded_length(n_ids: int, images: tuple[ImageRef, ...] | list[ImageRef]) -> int:
    """The prompt's length on the server: each image's one placeholder becomes its ``tokens``."""
    return n_ids + sum(image.tokens - 1 for image in images)


def expand_ids(ids: list[int], images: tuple[ImageRef, ...] | list[ImageRef]) -> list[int]:
    """``ids`` as the server sees them once it expanded each image's one placeholder (at its ``position``) into
    ``tokens`` copies of that placeholder id — what SGLang ≥ 0.5.13 returns as ``prompt_token_ids``
    (``base_processor._expand_input_ids``). ValueError for a reference whose position is not in ``ids``."""
    out: list[int] = []
    start = 0
    for image in sorted(images, key=lambda m: m.position):
        if not start <= image.position < len(ids):
            raise ValueError(f"image {image.sha256[:12]} placeholder position {image.position} is not in the ids")
        out.extend(ids[start : image.position])
        out.extend([ids[image.position]] * image.tokens)
        start = image.position + 1
    out.extend(ids[start:])
    return out


def load_rule(model_dir: str) -> ImageRule:
    """The rule of the model directory ``model_dir`` (its ``preprocessor_config.json``), as the server's processor
    reads it at start; :class:`VisionError` when the file is missing or unreadable (a text-only model)."""
    import json
    from pathlib import Path

    path = Path(model_dir).expanduser() / PREPROCESSOR_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise VisionError(f"{path}: no such file (a model without an image processor)") from None
    except (OSError, ValueError) as exc:
        raise VisionError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise VisionError(f"{path}: a JSON {type(config).__name__}, not an object")
    return image_rule(config, str(path))
