"""A Kimi-shaped tokenizer built offline, for tests, benchmarks and the simulator.

The real Kimi-K2.5 tokenizer is tiktoken-based, needs ``trust_remote_code`` and a download. This one
loads through ``AutoTokenizer.from_pretrained(path)`` with no network and has the same *layout*:

- a byte-level BPE base vocabulary of exactly 163,584 ids. The merges are learned from the built-in
  corpus (:mod:`thinkfleet.testing.corpus`); the learned tokens are scattered over the whole base range
  (seeded) and the rest is filled with decodable filler words, so token ids span 18 bits like Kimi's
  and compression figures measured with it are not flattered by small ids;
- Kimi's special tokens at their real ids 163584–163607 and ``<|reserved_token_N|>`` up to 163839
  (vocab 163,840), ``eos_token`` ``<|im_end|>``;
- a chat template of K2.5's shape (reference §4.2): role headers + name + ``<|im_middle|>``, content,
  ``<|im_end|>``, no newlines between turns, a default system turn, a ``tool_declare`` turn (JSON here;
  the real K2.5 renders TypeScript-style declarations), tool results as ``## Return of {id}``, history
  reasoning dropped, and a generation prompt ending in ``<think>`` (or ``<think></think>`` with
  ``thinking=False``).

Building takes a few seconds; the directory is cached by content, so a second call is instant.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from thinkfleet import kimi
from thinkfleet.testing.corpus import CORPUS

#: Bump when the builder changes in a way the content hash below cannot see.
BUILDER_VERSION = 1
#: Merges learned from the corpus at most (the corpus is small, so it usually stops earlier).
TRAIN_VOCAB_SIZE = 4096
#: Seed of the id scattering.
ID_SEED = 20250213
#: Written last into a built directory; holds the content hash the directory was built for.
MARKER = ".thinkfleet-test-tokenizer"
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

#: Added but not special (they survive ``skip_special_tokens``): the tool-call markers, as Kimi's
#: tokenizer_config declares them; the think markers too (their flag is not in our sources, and keeping
#: them visible in decoded text is the safer choice for reasoning data).
NOT_SPECIAL = {
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
}

# Written for this project from the structure described in reference §4.2 (not a copy of Moonshot's
# file). ``ns.hist`` is the 1-based index of the last assistant turn without tool calls: it and every
# turn before it are history, whose reasoning the K2 family drops.
CHAT_TEMPLATE = (
    "{%- macro header(m) -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ m.get('name') or m['role'] }}<|im_middle|>"
    "{%- endmacro -%}"
    "{%- macro body(m) -%}"
    "{%- set c = m.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part.get('type', 'text') == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro calls(m) -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- set args = call['function']['arguments'] -%}"
    "{%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endmacro -%}"
    "{%- set ns = namespace(hist=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.hist = loop.index -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- header(m) -}}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.index <= ns.hist -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{{- body(m) -}}"
    "{%- if m.get('tool_calls') -%}{{- calls(m) -}}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "## Return of {{ m.get('tool_call_id') }}\n{{ body(m) }}"
    "{%- else -%}{{- body(m) -}}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def special_token_layout() -> dict[int, str]:
    """id → token for the whole special/reserved block 163584–163839."""
    by_id = {token_id: token for token, token_id in kimi.SPECIAL_TOKENS.items()}
    return {
        token_id: by_id.get(token_id, f"<|reserved_token_{token_id}|>")
        for token_id in range(kimi.FIRST_SPECIAL_ID, kimi.VOCAB_SIZE)
    }


def content_hash() -> str:
    """Hash of everything the built directory depends on (the cache key)."""
    spec = {
        "builder": BUILDER_VERSION,
        "corpus": CORPUS,
        "train_vocab": TRAIN_VOCAB_SIZE,
        "seed": ID_SEED,
        "template": CHAT_TEMPLATE,
        "specials": special_token_layout(),
        "not_special": sorted(NOT_SPECIAL),
        "vocab": kimi.VOCAB_SIZE,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def default_test_tokenizer_dir(base: str | os.PathLike[str] | None = None) -> Path:
    """Where the cached test tokenizer lives: ``base`` or ``$THINKFLEET_CACHE_DIR`` or ~/.cache/thinkfleet."""
    root = Path(base or os.environ.get("THINKFLEET_CACHE_DIR") or Path.home() / ".cache" / "thinkfleet")
    return root / f"kimi-test-tokenizer-{content_hash()}"


def is_built(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a complete build of the current content."""
    marker = Path(path) / MARKER
    try:
        return marker.read_text().strip() == content_hash()
    except OSError:
        return False


def build_test_tokenizer(path: str | os.PathLike[str] | None = None) -> Path:
    """Write (or reuse) the test tokenizer directory at ``path`` (default: the cached location).

    Safe to call from several processes at once: each builds in a private temporary directory and
    the first to finish renames it into place.
    """
    target = Path(path) if path is not None else default_test_tokenizer_dir()
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared with other users and containers
    try:
        _write(tmp)
        if target.exists() and not is_built(target):
            shutil.rmtree(target, ignore_errors=True)  # a stale or half-written build
        try:
            tmp.rename(target)
        except OSError:
            if not is_built(target):  # lost the race to a broken writer: retry once ourselves
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # 1. Learn merges from the corpus.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TRAIN_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainer_tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    learned: list[str] = [tok for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]

    # 2. Scatter the learned tokens over the base range and fill the rest with filler words.
    base = kimi.FIRST_SPECIAL_ID
    slots = random.Random(ID_SEED).sample(range(base), len(learned))
    vocab = dict(zip(learned, slots, strict=True))
    taken = set(slots)
    fillers = _filler_words(set(vocab))
    for token_id in range(base):
        if token_id not in taken:
            vocab[next(fillers)] = token_id
    assert len(vocab) == base

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    # 3. The special block, one token at a time so each lands on its id.
    for token_id, token in special_token_layout().items():
        added = AddedToken(token, special=token not in NOT_SPECIAL, normalized=False)
        if added.special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"test tokenizer: {token} landed on {tok.token_to_id(token)}, not {token_id}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        pad_token="[PAD]",
        chat_template=CHAT_TEMPLATE,
        model_max_length=262_144,
    )
    fast.save_pretrained(str(directory))
    # What a model directory carries next to the tokenizer: the producer reads stop ids from here.
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [kimi.IM_END], "bos_token_id": kimi.BOS}, indent=2) + "\n"
    )
    (directory / MARKER).write_text(content_hash() + "\n")


def _filler_words(avoid: set[str]):
    """Endless unique pseudo-words (" ka", " kabo", …) in byte-level form, so fillers decode to text."""
    onsets = "bdfghklmnprstvz"
    vowels = "aeiou"
    syllables = [o + v for o in onsets for v in vowels]  # 75
    n = 0
    while True:
        word, k = "", n
        while True:
            word += syllables[k % len(syllables)]
            k //= len(syllables)
            if not k:
                break
        n += 1
        token = "Ġ" + word  # byte-level spelling of a leading space
        if token not in avoid:
            yield token
