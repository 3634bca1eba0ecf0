"""Kimi-K2 / K2.5 special-token ids, as their ``tokenizer_config.json`` declares them.

The real tokenizer is tiktoken-based and needs ``trust_remote_code``; these ids are what its
``tokenizer_config.json`` declares. The producer reads every marker id from the loaded tokenizer through
the job's model profile (:mod:`thinkfleet.profiles`), never from here: these constants are what a job
record written before model profiles means (those were Kimi jobs), the simulator's default vocabulary
and the Kimi test tokenizer's layout.
"""

from __future__ import annotations

#: Size of the embedding table: 163,584 tiktoken ranks + 256 reserved/special ids.
VOCAB_SIZE = 163_840
#: First id of the special/reserved block.
FIRST_SPECIAL_ID = 163_584

BOS = 163584
EOS = 163585
IM_END = 163586
IM_USER = 163587
IM_ASSISTANT = 163588
START_HEADER = 163590
END_HEADER = 163591
EOT = 163593
IM_SYSTEM = 163594
TOOL_CALLS_SECTION_BEGIN = 163595
TOOL_CALLS_SECTION_END = 163596
TOOL_CALL_BEGIN = 163597
TOOL_CALL_ARGUMENT_BEGIN = 163598
TOOL_CALL_END = 163599
IM_MIDDLE = 163601
MEDIA_BEGIN = 163602
MEDIA_CONTENT = 163603
MEDIA_END = 163604
MEDIA_PAD = 163605
THINK_START = 163606
THINK_END = 163607
UNK = 163838
PAD = 163839

#: token string → id, as in Kimi's tokenizer_config ``added_tokens_decoder``.
SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": BOS,
    "[EOS]": EOS,
    "<|im_end|>": IM_END,
    "<|im_user|>": IM_USER,
    "<|im_assistant|>": IM_ASSISTANT,
    "<|start_header_id|>": START_HEADER,
    "<|end_header_id|>": END_HEADER,
    "[EOT]": EOT,
    "<|im_system|>": IM_SYSTEM,
    "<|tool_calls_section_begin|>": TOOL_CALLS_SECTION_BEGIN,
    "<|tool_calls_section_end|>": TOOL_CALLS_SECTION_END,
    "<|tool_call_begin|>": TOOL_CALL_BEGIN,
    "<|tool_call_argument_begin|>": TOOL_CALL_ARGUMENT_BEGIN,
    "<|tool_call_end|>": TOOL_CALL_END,
    "<|im_middle|>": IM_MIDDLE,
    "<|media_begin|>": MEDIA_BEGIN,
    "<|media_content|>": MEDIA_CONTENT,
    "<|media_end|>": MEDIA_END,
    "<|media_pad|>": MEDIA_PAD,
    "<think>": THINK_START,
    "</think>": THINK_END,
    "[UNK]": UNK,
    "[PAD]": PAD,
}

#: Ids that end a generation by default (an assistant turn ends with <|im_end|>; [EOS] is a safety net).
DEFAULT_STOP_TOKEN_IDS: tuple[int, ...] = (IM_END, EOS)
