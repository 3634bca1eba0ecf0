"""Model-shaped tokenizers built offline, for the demo, tests, benchmarks and the simulator.

Real reasoning-model tokenizers need a download (Kimi's also ``trust_remote_code``). These load through
``AutoTokenizer.from_pretrained(path)`` with no network and have a real family's *layout*:
``build_test_tokenizer(path, family=...)`` with

- ``kimi`` (default): a byte-level BPE base vocabulary of exactly 163,584 ids. The merges are learned
  from the built-in corpus (:data:`CORPUS`); the learned tokens are scattered over the
  whole base range (seeded) and the rest is filled with decodable filler words, so token ids span 18 bits
  like Kimi's and compression figures measured with it are not flattered by small ids; Kimi's special
  tokens at their real ids 163584–163607 and ``<|reserved_token_N|>`` up to 163839 (vocab 163,840),
  ``eos_token`` ``<|im_end|>``; a chat template of K2.5's shape (its released template): role headers + name +
  ``<|im_middle|>``, content, ``<|im_end|>``, no newlines between turns, a default system turn, a
  ``tool_declare`` turn (JSON here; the real K2.5 renders TypeScript-style declarations), tool results as
  ``## Return of {id}``, history reasoning dropped, and a generation prompt ending in ``<think>`` (or
  ``<think></think>`` with ``thinking=False``);
- ``qwen3``: the same kind of base vocabulary over 151,643 ids and Qwen3's added tokens at their real ids
  151643–151668 (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645, ``<tool_call>``
  151657, ``</tool_call>`` 151658, ``<think>`` 151667, ``</think>`` 151668; the think/tool ones not
  special, as in Qwen3's tokenizer_config); a ChatML template of Qwen3's shape: ``<|im_start|>role\n…
  <|im_end|>\n``, tools declared in the system turn inside ``<tools></tools>``, assistant tool calls as
  ``<tool_call>\n{"name": …, "arguments": …}\n</tool_call>``, tool results as a user turn of
  ``<tool_response>`` blocks, reasoning kept only after the last user query, and a generation prompt
  ``<|im_start|>assistant\n`` (the model opens ``<think>`` itself) or, with ``enable_thinking=False``,
  ``…<think>\n\n</think>\n\n``;
- ``qwen3-thinking``: the ``qwen3`` tokenizer with the template of Qwen3-Thinking-2507, whose generation
  prompt already opens reasoning: ``<|im_start|>assistant\n<think>\n`` (the model's output starts inside
  reasoning, with no ``<think>`` of its own; DeepSeek-R1-0528 ends its prompt the same way);
- ``harmony`` (gpt-oss): a base vocabulary over 199,998 ids where the words ``analysis`` (35644),
  ``final`` (17196) and ``assistant`` (173781) are single tokens at their o200k ids, and the
  ``o200k_harmony`` special block 199998–201087 (``<|return|>`` 200002, ``<|constrain|>`` 200003,
  ``<|channel|>`` 200005, ``<|start|>`` 200006, ``<|end|>`` 200007, ``<|message|>`` 200008, ``<|call|>``
  200012, ``<|reserved_N|>`` elsewhere; vocab 201,088); a harmony template: a system message with the
  reasoning effort and the valid channels, a developer message with the instructions and a
  ``namespace functions`` of the tools, ``<|start|>role<|message|>…<|end|>`` turns, assistant history on
  the ``final`` channel, tool calls as ``<|start|>assistant to=functions.NAME<|channel|>commentary json
  <|message|>ARGS<|call|>``, tool results from ``functions.NAME to=assistant``, and a generation prompt
  ``<|start|>assistant``;
- ``deepseek`` (DeepSeek-R1-0528 / V3 layout): a base vocabulary over 128,000 ids whose ids 0–2 are the
  special ``<｜begin▁of▁sentence｜>``, ``<｜end▁of▁sentence｜>`` (EOS) and ``<｜▁pad▁｜>``, as in DeepSeek's
  tokenizer, and the added block 128000–128814 with DeepSeek's markers at their real ids (``<think>`` 128798,
  ``</think>`` 128799, ``<｜User｜>`` 128803, ``<｜Assistant｜>`` 128804, ``<｜tool▁calls▁begin｜>``/end
  128806/128807, ``<｜tool▁call▁begin｜>``/end 128808/128809, tool outputs 128810–128813, ``<｜tool▁sep｜>``
  128814; ``<｜place▁holder▁no▁N｜>`` elsewhere); a template of R1-0528's shape: BOS, the system prompt,
  ``<｜User｜>…``, earlier answers as ``<｜Assistant｜>content<｜end▁of▁sentence｜>`` (reasoning dropped), tool
  calls as ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>``, and a
  generation prompt ``<｜Assistant｜><think>\n`` (``…</think>`` with ``thinking=False``);
- ``glm45`` (GLM-4.5): a base vocabulary over 151,329 ids and GLM-4.5's added block 151329–151551
  (``<|endoftext|>`` 151329, ``[gMASK]`` 151331, ``<sop>`` 151333, ``<|system|>``/``<|user|>``/``<|assistant|>``/
  ``<|observation|>`` 151335–151338, ``<think>``/``</think>`` 151350/151351, ``<tool_call>``/``</tool_call>``
  151352/151353, ``<arg_key>`` 151356; see :data:`GLM45_SPECIALS` for which ids were checked); a template of
  GLM-4.5's shape (:data:`GLM45_CHAT_TEMPLATE`) whose generation prompt is ``<|assistant|>`` — the model opens
  ``<think>`` itself — or ``<|assistant|>\\n<think></think>`` with ``enable_thinking=False``;
- ``plain``: a ChatML tokenizer *without* reasoning tokens (Qwen2.5-shaped: 151643–151664, no
  ``<think>``): what a submit of a non-reasoning model looks like.

Building takes a few seconds; each directory is cached by content, so a second call is instant.

Why this sits in the foundation: ``python -m demo`` (a product command) renders its prompts with
the ``kimi`` tokenizer, and the foundation imports nothing above it (tests/test_architecture.py). The builder
needs only :mod:`thinkfleet.kimi` and the corpus it trains on (:data:`CORPUS`, kept here for that reason), so
it lives whole in this module; the test-support package re-exports it as ``testing.tokenizer`` for the tests
and benchmarks, and ``testing.corpus`` builds synthetic prompt text from the corpus' words.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from demo.families import CHAT_TEMPLATE, FAMILIES, NOT_SPECIAL, Layout, layout, special_token_layout
from thinkfleet import kimi

#: The built-in text the tokenizer's merges are learned from. Written for this project (no third-party text):
#: mixed prose, arithmetic, code and a little Chinese, so the byte-level BPE learns merges for the kinds of
#: strings prompts contain (``testing/corpus.py`` draws synthetic prompts from its words).
CORPUS = """\
The pipeline reads every prompt once, renders it with the model's own chat template and stores the
exact token ids. A drafter trained on those ids learns what the target model really emits, including
the reasoning that comes before the answer. When the reasoning is missing, the drafter cannot predict
the thinking tokens, and the acceptance rate falls to almost nothing.

Question: A train leaves the station at 9:15 and travels 240 kilometres at 80 kilometres per hour.
When does it arrive? Answer: the trip takes 240 / 80 = 3 hours, so it arrives at 12:15.
Question: What is the sum of the first 100 positive integers? Answer: 100 * 101 / 2 = 5050.
Question: Solve 3x + 7 = 22. Answer: 3x = 15, therefore x = 5.
Let f(x) = x^2 - 4x + 4. Then f(x) = (x - 2)^2, which is zero only at x = 2 and positive elsewhere.
The probability of rolling two sixes with two fair dice is 1/36, about 2.78 percent.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

for (int i = 0; i < count; ++i) {
    total += weights[i] * inputs[i];
}
SELECT dataset, COUNT(*) AS prompts FROM samples WHERE finish_reason = 'stop' GROUP BY dataset;
{"name": "get_weather", "description": "Current weather for a city", "parameters": {"type": "object",
"properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
"required": ["city"]}}

Please summarize the following article in three sentences. Explain your reasoning step by step.
Write a short story about a lighthouse keeper who finds a message in a bottle. Translate the paragraph
into French, then list the five most important ideas. Review this function and suggest improvements.
You are a helpful assistant. Think carefully, check each intermediate result, and give a final answer.
The user asked for a plan; the assistant proposed three options and compared their costs and risks.
Historical records show that the bridge was rebuilt in 1887 after a flood destroyed the wooden span.
Photosynthesis converts light energy, water and carbon dioxide into glucose and oxygen in chloroplasts.
The committee will meet on Tuesday to review the budget, the schedule and the hiring plan for next year.

请用三句话总结下面的文章。我们需要仔细思考每一个步骤，然后给出最终答案。
数据集包含八万八千条提示，每条提示大约八百个词元。

Wait, let me reconsider. If the queue is empty but the job is not finished, some prompts may be lost;
the producer can re-submit the job, and only the missing prompts are enqueued again. First, check the
counts. Second, compare them with storage. Finally, report what is missing and why. Therefore the
answer is consistent, and no prompt is generated twice.
"""

#: Bump when the builder changes in a way the content hash below cannot see.
BUILDER_VERSION = 1
#: Merges learned from the corpus at most (the corpus is small, so it usually stops earlier).
TRAIN_VOCAB_SIZE = 4096
#: Seed of the id scattering.
ID_SEED = 20250213
#: Written last into a built directory; holds the content hash the directory was built for.
MARKER = ".thinkfleet-test-tokenizer"


def content_hash(family: str = "kimi") -> str:
    """Hash of everything the built directory depends on (the cache key)."""
    spec: dict[str, object] = {
        "builder": BUILDER_VERSION,
        "corpus": CORPUS,
        "train_vocab": TRAIN_VOCAB_SIZE,
        "seed": ID_SEED,
    }
    lay = layout(family)
    if family == "kimi":  # the spec Kimi's directories were always keyed by
        spec.update(
            template=CHAT_TEMPLATE,
            specials=special_token_layout(),
            not_special=sorted(NOT_SPECIAL),
            vocab=kimi.VOCAB_SIZE,
        )
    else:
        spec.update(
            family=family,
            template=lay.template,
            specials=lay.specials,
            not_special=sorted(lay.not_special),
            vocab=lay.vocab_size,
            tokens=[lay.eos, lay.bos, lay.unk, lay.pad, list(lay.generation_eos), lay.generation_bos],
            pinned=lay.pinned,
            **({"pinned_special": sorted(lay.pinned_special)} if lay.pinned_special else {}),
            max_length=lay.model_max_length,
        )
    if lay.preprocessor is not None:  # a vision family's image processor (absent: the hash stays what it was)
        spec["preprocessor"] = lay.preprocessor
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def default_test_tokenizer_dir(base: str | os.PathLike[str] | None = None, family: str = "kimi") -> Path:
    """Where a cached test tokenizer lives: ``base`` or ``$THINKFLEET_CACHE_DIR`` or ~/.cache/thinkfleet."""
    root = Path(base or os.environ.get("THINKFLEET_CACHE_DIR") or Path.home() / ".cache" / "thinkfleet")
    return root / f"{family}-test-tokenizer-{content_hash(family)}"


def is_built(path: str | os.PathLike[str], family: str = "kimi") -> bool:
    """True when ``path`` holds a complete build of the current content."""
    marker = Path(path) / MARKER
    try:
        return marker.read_text().strip() == content_hash(family)
    except OSError:
        return False


def build_test_tokenizer(path: str | os.PathLike[str] | None = None, family: str | None = None) -> Path:
    """Write (or reuse) the ``family`` test tokenizer directory at ``path`` (default: the cached location).

    ``family`` None: the family a :func:`default_test_tokenizer_dir` path names (``qwen3-test-tokenizer-…``),
    else ``kimi``. Safe to call from several processes at once: each builds in a private temporary
    directory and the first to finish renames it into place.
    """
    if family is None:
        name = Path(path).name if path is not None else ""
        family = next((f for f in FAMILIES if name.startswith(f"{f}-test-tokenizer-")), "kimi")
    lay = layout(family)
    target = Path(path) if path is not None else default_test_tokenizer_dir(family=family)
    if is_built(target, family):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared with other users and containers
    try:
        _write(tmp, lay)
        if target.exists() and not is_built(target, family):
            shutil.rmtree(target, ignore_errors=True)  # a stale or half-written build
        try:
            tmp.rename(target)
        except OSError:
            if not is_built(target, family):  # lost the race to a broken writer: retry once ourselves
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(directory: Path, lay: Layout | None = None) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lay = lay or layout("kimi")
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

    # 2. Scatter the learned tokens over the base range and fill the rest with filler words; pinned
    #    words take their fixed ids (a learned one moves there, its scattered slot goes to a filler).
    base = lay.base_size
    pinned_ids = set(lay.pinned.values())
    free_range = [i for i in range(base) if i not in pinned_ids] if pinned_ids else range(base)
    slots = random.Random(ID_SEED).sample(free_range, len(learned))
    vocab = dict(zip(learned, slots, strict=True))
    vocab.update(lay.pinned)
    taken = set(vocab.values())
    fillers = _filler_words(set(vocab))
    for token_id in range(base):
        if token_id not in taken:
            vocab[next(fillers)] = token_id
    assert len(vocab) == base and len(set(vocab.values())) == base

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    # 3. Pinned words always encode to their one id (as o200k's "analysis" does after <|channel|>).
    for word, token_id in lay.pinned.items():
        if word in lay.pinned_special:
            tok.add_special_tokens([AddedToken(word, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(word, special=False, normalized=False, single_word=True)])
        if tok.token_to_id(word) != token_id:
            raise RuntimeError(f"test tokenizer: {word} is {tok.token_to_id(word)}, not {token_id}")

    # 4. The special block, in runs of one kind (special or not) so each token lands on its id.
    items = sorted(lay.specials.items())
    run: list[AddedToken] = []
    for k, (_, token) in enumerate(items):
        run.append(AddedToken(token, special=token not in lay.not_special, normalized=False))
        last = k == len(items) - 1
        if last or (items[k + 1][1] in lay.not_special) != (token in lay.not_special):
            if run[0].special:
                tok.add_special_tokens(run)
            else:
                tok.add_tokens(run)
            run = []
    for token_id, token in items:
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"test tokenizer: {token} landed on {tok.token_to_id(token)}, not {token_id}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=lay.bos,
        eos_token=lay.eos,
        unk_token=lay.unk,
        pad_token=lay.pad,
        chat_template=lay.template,
        model_max_length=lay.model_max_length,
    )
    fast.save_pretrained(str(directory))
    # What a model directory carries next to the tokenizer: the producer reads stop ids from here.
    generation = {"eos_token_id": list(lay.generation_eos), "bos_token_id": lay.generation_bos}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if lay.preprocessor is not None:  # a vision model's image processor sizes (thinkfleet/vision.py reads them)
        (directory / "preprocessor_config.json").write_text(json.dumps(lay.preprocessor, indent=2) + "\n")
    (directory / MARKER).write_text(content_hash(lay.family) + "\n")


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
