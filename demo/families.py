"""The test tokenizers' families, one :class:`Layout` each: the special tokens at the real ids of the family's
tokenizer, which of them are not special, the stop and start ids of its ``generation_config.json``, and a chat
template of the family's shape (written for this project from the structure of each released template, never a
copy). :func:`layout` names them; the builder (demo/tokenizer.py) turns a layout into a tokenizer directory, and its
docstring says what each family reproduces and why.

Kept apart from the builder because the two change for different reasons: a template follows its family's release
(a new tool-call form, a reasoning rule), the builder follows ``tokenizers``' API and the cache format.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from thinkfleet import kimi

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

# Written for this project from the structure of K2.5's released template (not a copy of Moonshot's
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
    # One placeholder per image part, then a newline, as K2.5's template renders it (tinker-cookbook's K2.5
    # renderer and its test of the HF template: ``<|media_end|>\n``; docs/vision.md).
    "{%- else -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{{ '\\n' }}{%- endif -%}"
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


#: Kimi-K2.5's image processor sizes (the checkpoint's ``preprocessor_config.json`` ``media_proc_cfg``, the values
#: SGLang's image-only fallback processor also carries).
KIMI_PREPROCESSOR: dict[str, Any] = {
    "processor_class": "KimiK25Processor",
    "media_proc_cfg": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 16384,
        "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}


# -- Qwen3 ---------------------------------------------------------------------------------------------
#: Qwen3's added tokens (``added_tokens.json`` of the Qwen3 checkpoints), at their real ids.
QWEN3_SPECIALS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
QWEN3_FIRST_SPECIAL_ID = 151643
#: Qwen3-VL's image processor (its ``preprocessor_config.json``): patch 16, merge 2 (a 32 px factor), 64×64 px to
#: 4096×4096 px; the Qwen3 test tokenizer stands in for a Qwen3-VL model directory.
QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
#: Qwen3's tokenizer_config marks these ``special: false`` (they survive ``skip_special_tokens``).
QWEN3_NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}


def _keep_newlines(template: str) -> str:
    """Every newline of the template's text as a ``{{ '\\n' }}`` expression: ``{%- … -%}`` tags strip the
    whitespace of the text next to them, never an expression's output."""
    return template.replace("\n", "{{ '\\n' }}")


#: ``text(c)``: a message's content, a string or the text parts of a list (other parts dropped).
_TEXT_MACRO = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part.get('type', 'text') == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

# Written for this project after the structure of Qwen3's chat template (not a copy of it).
_CHATML_BODY = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part.get('type', 'text') == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro calls(m, content) -%}"
    "{%- for call in m['tool_calls'] -%}"
    "{%- if (loop.first and content) or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- set args = f['arguments'] -%}"
    '<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": '
    "{{ args if args is string else (args | tojson) }}}\n</tool_call>"
    "{%- endfor -%}"
    "{%- endmacro -%}"
)
QWEN3_CHAT_TEMPLATE = _keep_newlines(
    _CHATML_BODY + "{%- if tools -%}"
    "<|im_start|>system\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ text(messages[0].get('content')) }}\n\n{%- endif -%}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools -%}\n{{ tool | tojson }}{%- endfor -%}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages and messages[0]['role'] == 'system' -%}"
    "<|im_start|>system\n{{ text(messages[0].get('content')) }}<|im_end|>\n"
    "{%- endif -%}"
    # The last user query: reasoning is kept only for the assistant turns after it.
    "{%- set ns = namespace(last_query=messages | length - 1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = text(m.get('content')) -%}"
    "{%- if m['role'] == 'user' or (m['role'] == 'system' and not loop.first) -%}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "<|im_start|>assistant\n<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n{{ content.lstrip('\\n') }}"
    "{%- else -%}<|im_start|>assistant\n{{ content }}{%- endif -%}"
    "{%- if m.get('tool_calls') -%}{{ calls(m, content) }}{%- endif -%}"
    "<|im_end|>\n"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<|im_start|>user{%- endif -%}"
    "\n<tool_response>\n{{ content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}<|im_end|>\n{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think>\n\n</think>\n\n{%- endif -%}"
    "{%- endif -%}"
)

#: Qwen3-Thinking-2507: always thinking, and the generation prompt opens the reasoning itself.
QWEN3_THINKING_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "<think>{{ '\\n' }}{{ '\\n' }}</think>{{ '\\n' }}{{ '\\n' }}{%- endif -%}",
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}<think>{{ '\\n' }}",
)
assert QWEN3_THINKING_CHAT_TEMPLATE != QWEN3_CHAT_TEMPLATE

# -- DeepSeek-R1-0528 / V3 ------------------------------------------------------------------------------------
#: DeepSeek's special tokens inside the base range (tokenizer.json ``added_tokens`` 0–2).
DEEPSEEK_LOW: dict[str, int] = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2}
#: id → token of DeepSeek-V3/R1's named added tokens (thinkfleet.profiles.DEEPSEEK; tool outputs 128810–128813).
DEEPSEEK_ADDED: dict[int, str] = {
    128798: "<think>",
    128799: "</think>",
    128803: "<｜User｜>",
    128804: "<｜Assistant｜>",
    128805: "<|EOT|>",
    128806: "<｜tool▁calls▁begin｜>",
    128807: "<｜tool▁calls▁end｜>",
    128808: "<｜tool▁call▁begin｜>",
    128809: "<｜tool▁call▁end｜>",
    128810: "<｜tool▁outputs▁begin｜>",
    128811: "<｜tool▁outputs▁end｜>",
    128812: "<｜tool▁output▁begin｜>",
    128813: "<｜tool▁output▁end｜>",
    128814: "<｜tool▁sep｜>",
}
#: Kept visible by ``skip_special_tokens`` (the reasoning and tool-call markers), as for Kimi.
DEEPSEEK_NOT_SPECIAL = {"<think>", "</think>", *(t for i, t in DEEPSEEK_ADDED.items() if 128806 <= i <= 128814)}

# Written for this project after the structure of DeepSeek-R1-0528's chat template (not a copy of it).
DEEPSEEK_CHAT_TEMPLATE = _keep_newlines(
    _TEXT_MACRO + "<｜begin▁of▁sentence｜>"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ text(messages[0].get('content')) }}{%- endif -%}"
    "{%- if tools -%}\n\n## Tools\n{%- for tool in tools -%}\n{{ tool | tojson }}{%- endfor -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<｜User｜>{{ text(m.get('content')) }}"
    "{%- elif m['role'] == 'assistant' -%}<｜Assistant｜>{{ text(m.get('content')) }}"
    "{%- if m.get('tool_calls') -%}<｜tool▁calls▁begin｜>"
    "{%- for call in m['tool_calls'] -%}{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- set args = f['arguments'] -%}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ f['name'] }}\n```json\n"
    "{{ args if args is string else (args | tojson) }}\n```<｜tool▁call▁end｜>"
    "{%- endfor -%}<｜tool▁calls▁end｜>{%- endif -%}"
    "<｜end▁of▁sentence｜>"
    "{%- elif m['role'] == 'tool' -%}"
    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ text(m.get('content')) }}"
    "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>"
    "{%- if thinking is defined and thinking is false -%}</think>{%- else -%}<think>\n{%- endif -%}"
    "{%- endif -%}"
)

# -- GLM-4.5 -----------------------------------------------------------------------------------------------
#: GLM-4.5's added tokens (tokenizer_config.json ``added_tokens_decoder``). [gMASK] 151331, <|system|> 151335,
#: <|user|> 151336 and <|assistant|> 151337 were checked against a public GLM-4.5 tokenizer test; the rest of the
#: block (<sop> 151333, <|observation|> 151338, <think>/</think> 151350/151351, <tool_call>/</tool_call>
#: 151352/151353, <arg_key> … </arg_value> 151356–151359, /nothink 151360) is from memory of that file, in its
#: order, not checked against a copy. Ids 151365–151551 (up to the config's vocab 151,552) are placeholders here.
GLM45_SPECIALS: dict[str, int] = {
    "<|endoftext|>": 151329,
    "[MASK]": 151330,
    "[gMASK]": 151331,
    "[sMASK]": 151332,
    "<sop>": 151333,
    "<eop>": 151334,
    "<|system|>": 151335,
    "<|user|>": 151336,
    "<|assistant|>": 151337,
    "<|observation|>": 151338,
    "<|begin_of_image|>": 151339,
    "<|end_of_image|>": 151340,
    "<|begin_of_video|>": 151341,
    "<|end_of_video|>": 151342,
    "<|begin_of_audio|>": 151343,
    "<|end_of_audio|>": 151344,
    "<|begin_of_transcription|>": 151345,
    "<|end_of_transcription|>": 151346,
    "<|code_prefix|>": 151347,
    "<|code_middle|>": 151348,
    "<|code_suffix|>": 151349,
    "<think>": 151350,
    "</think>": 151351,
    "<tool_call>": 151352,
    "</tool_call>": 151353,
    "<tool_response>": 151354,
    "</tool_response>": 151355,
    "<arg_key>": 151356,
    "</arg_key>": 151357,
    "<arg_value>": 151358,
    "</arg_value>": 151359,
    "/nothink": 151360,
    "<|begin_of_box|>": 151361,
    "<|end_of_box|>": 151362,
    "<|image|>": 151363,
    "<|video|>": 151364,
}
GLM45_FIRST_SPECIAL_ID = 151_329
GLM45_VOCAB_SIZE = 151_552
#: Kept visible by ``skip_special_tokens`` (reasoning and tool-call markers), as for the other families.
GLM45_NOT_SPECIAL = {t for t, i in GLM45_SPECIALS.items() if 151350 <= i <= 151360}

# Written for this project after the structure of GLM-4.5's chat template (not a copy of it): ``[gMASK]<sop>``,
# tools declared in a system turn, ``<|role|>\ncontent`` turns with no end marker, assistant turns as
# ``<|assistant|>\n<think>REASONING</think>\nCONTENT`` (reasoning kept only after the last user turn), tool calls
# as ``<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>``, tool results in an
# ``<|observation|>`` turn, and a generation prompt ``<|assistant|>`` (the model opens ``<think>`` itself) or,
# with ``enable_thinking=False``, ``/nothink`` after the last user message and ``<|assistant|>\n<think></think>``.
GLM45_CHAT_TEMPLATE = _keep_newlines(
    _TEXT_MACRO + "[gMASK]<sop>"
    "{%- set off = enable_thinking is defined and enable_thinking is false -%}"
    "{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools -%}\n{{ tool | tojson }}{%- endfor -%}\n</tools>\n\nFor each function call, output the "
    "function name and arguments within the following XML format:\n<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = text(m.get('content')) -%}"
    "{%- if m['role'] == 'system' -%}<|system|>\n{{ content }}"
    "{%- elif m['role'] == 'user' -%}<|user|>\n{{ content }}"
    "{%- if off and loop.index0 == ns.last_user -%}/nothink{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "\n<think>{{ m.get('reasoning_content').strip() }}</think>"
    "{%- else -%}\n<think></think>{%- endif -%}"
    "{%- if content -%}\n{{ content.strip() }}{%- endif -%}"
    "{%- for call in m.get('tool_calls') or [] -%}{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- set args = f['arguments'] -%}"
    "\n<tool_call>{{ f['name'] }}\n"
    # Arguments given as a JSON string stay as written (a template has no JSON parser; GLM-4.5's parses them).
    "{%- if args is string -%}{{ args }}\n{%- else -%}{%- for k, v in args.items() -%}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else (v | tojson) }}</arg_value>\n{%- endfor -%}{%- endif -%}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<|observation|>{%- endif -%}"
    "\n<tool_response>\n{{ content }}\n</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- if off -%}\n<think></think>{%- endif -%}{%- endif -%}"
)

# -- plain ChatML (no reasoning tokens) ----------------------------------------------------------------------
PLAIN_SPECIALS: dict[str, int] = {t: i for t, i in QWEN3_SPECIALS.items() if i <= 151664}
PLAIN_CHAT_TEMPLATE = _keep_newlines(
    _CHATML_BODY + "{%- if tools -%}"
    "<|im_start|>system\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ text(messages[0].get('content')) }}"
    "{%- else -%}You are a helpful assistant.{%- endif -%}"
    "\n\n# Tools\n\n<tools>{%- for tool in tools -%}\n{{ tool | tojson }}{%- endfor -%}\n</tools><|im_end|>\n"
    "{%- elif messages and messages[0]['role'] == 'system' -%}"
    "<|im_start|>system\n{{ text(messages[0].get('content')) }}<|im_end|>\n"
    "{%- else -%}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = text(m.get('content')) -%}"
    "{%- if m['role'] == 'user' or (m['role'] == 'system' and not loop.first) -%}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n"
    "{%- elif m['role'] == 'assistant' -%}<|im_start|>assistant\n{{ content }}"
    "{%- if m.get('tool_calls') -%}{{ calls(m, content) }}{%- endif -%}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ content }}\n</tool_response><|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

# -- harmony (gpt-oss) ----------------------------------------------------------------------------------------
#: o200k_harmony's special tokens (openai/gpt-oss); every other id in 199998–201087 is ``<|reserved_N|>``.
HARMONY_SPECIALS: dict[str, int] = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
    "<|endofprompt|>": 200018,
}
HARMONY_FIRST_SPECIAL_ID = 199_998
HARMONY_VOCAB_SIZE = 201_088
#: Words that are one o200k token, pinned to their real ids (the simulator emits these ids).
HARMONY_WORDS: dict[str, int] = {"analysis": 35644, "final": 17196, "assistant": 173781}

# Written for this project after the structure of gpt-oss's chat template (not a copy of it).
HARMONY_CHAT_TEMPLATE = _keep_newlines(
    _TEXT_MACRO + "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: "
    "{{ reasoning_effort if (reasoning_effort is defined and reasoning_effort) else 'medium' }}"
    "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools -%}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif -%}"
    "<|end|>"
    "{%- set system = messages[0] if messages and messages[0]['role'] in ('system', 'developer') else none -%}"
    "{%- if system or tools -%}"
    "<|start|>developer<|message|>"
    "{%- if system -%}# Instructions\n\n{{ text(system.get('content')) }}{%- endif -%}"
    "{%- if tools -%}{%- if system -%}\n\n{%- endif -%}# Tools\n\n## functions\n\nnamespace functions {{ '{' }}\n\n"
    "{%- for tool in tools -%}{%- set f = tool['function'] if tool.get('function') else tool -%}"
    "// {{ f.get('description') or '' }}\ntype {{ f['name'] }} = (_: {{ (f.get('parameters') or {}) | tojson }})"
    " => any;\n\n"
    "{%- endfor -%}{{ '}' }} // namespace functions{%- endif -%}"
    "<|end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1, last_call='tool') -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] in ('system', 'developer') and loop.first -%}"
    "{%- elif m['role'] == 'user' -%}<|start|>user<|message|>{{ text(m.get('content')) }}<|end|>"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if m.get('tool_calls') -%}"
    # A tool-calling turn after the last user message keeps its reasoning (the model continues from it).
    "{%- if loop.index0 > ns.last_user and (m.get('reasoning_content') or m.get('thinking')) -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.get('reasoning_content') or m.get('thinking') }}<|end|>"
    "{%- endif -%}"
    "{%- for call in m['tool_calls'] -%}{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- set ns.last_call = f['name'] -%}"
    "<|start|>assistant to=functions.{{ f['name'] }}<|channel|>commentary json<|message|>"
    "{%- set args = f['arguments'] -%}"
    "{%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}<|call|>"
    "{%- endfor -%}"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ text(m.get('content')) }}<|end|>"
    "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "<|start|>functions.{{ m.get('name') or ns.last_call }} to=assistant<|channel|>commentary<|message|>"
    "{{ text(m.get('content')) }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


@dataclass(frozen=True)
class Layout:
    """What one family's test tokenizer is made of."""

    family: str
    #: ids [0, base_size) are the byte-level BPE base vocabulary.
    base_size: int
    #: id → token over the special block [base_size, vocab_size).
    specials: dict[int, str]
    not_special: frozenset[str]
    template: str
    eos: str
    bos: str | None = None
    unk: str | None = None
    pad: str | None = None
    #: ``generation_config.json``: what SGLang (and the producer) read the model's stop ids from.
    generation_eos: tuple[int, ...] = ()
    generation_bos: int | None = None
    #: words in the base range that are one token at a fixed id (added, not special).
    pinned: dict[str, int] = field(default_factory=dict)
    #: pinned tokens that are special (DeepSeek's BOS/EOS/pad at ids 0–2), not words.
    pinned_special: frozenset[str] = frozenset()
    model_max_length: int = 262_144
    #: ``preprocessor_config.json`` of the family's vision model (its image processor's sizes: how many tokens an
    #: image becomes, thinkfleet/vision.py); None: a text-only family.
    preprocessor: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int:
        return self.base_size + len(self.specials)


def special_token_layout() -> dict[int, str]:
    """id → token for Kimi's whole special/reserved block 163584–163839."""
    by_id = {token_id: token for token, token_id in kimi.SPECIAL_TOKENS.items()}
    return {
        token_id: by_id.get(token_id, f"<|reserved_token_{token_id}|>")
        for token_id in range(kimi.FIRST_SPECIAL_ID, kimi.VOCAB_SIZE)
    }


def layout(family: str = "kimi") -> Layout:
    """The layout of the ``family`` test tokenizer (:data:`FAMILIES`)."""
    if family == "kimi":
        return Layout(
            "kimi", kimi.FIRST_SPECIAL_ID, special_token_layout(), frozenset(NOT_SPECIAL), CHAT_TEMPLATE,
            eos="<|im_end|>", bos="[BOS]", unk="[UNK]", pad="[PAD]",
            generation_eos=(kimi.IM_END,), generation_bos=kimi.BOS, preprocessor=KIMI_PREPROCESSOR,
        )  # fmt: skip
    if family == "qwen3":
        return Layout(
            "qwen3", QWEN3_FIRST_SPECIAL_ID, {i: t for t, i in QWEN3_SPECIALS.items()},
            frozenset(QWEN3_NOT_SPECIAL), QWEN3_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>",
            generation_eos=(151645, 151643), generation_bos=151643, model_max_length=131_072,
            preprocessor=QWEN3_VL_PREPROCESSOR,
        )  # fmt: skip
    if family == "qwen3-thinking":
        return replace(layout("qwen3"), family=family, template=QWEN3_THINKING_CHAT_TEMPLATE)
    if family == "deepseek":
        specials = {i: DEEPSEEK_ADDED.get(i, f"<｜place▁holder▁no▁{i - 128000}｜>") for i in range(128000, 128815)}
        return Layout(
            "deepseek", 128_000, specials, frozenset(DEEPSEEK_NOT_SPECIAL), DEEPSEEK_CHAT_TEMPLATE,
            eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
            pad="<｜▁pad▁｜>", generation_eos=(1,), generation_bos=0, pinned=dict(DEEPSEEK_LOW),
            pinned_special=frozenset(DEEPSEEK_LOW), model_max_length=131_072,
        )  # fmt: skip
    if family == "glm45":
        by_id = {i: t for t, i in GLM45_SPECIALS.items()}
        specials = {i: by_id.get(i, f"<|reserved_token_{i}|>") for i in range(GLM45_FIRST_SPECIAL_ID, GLM45_VOCAB_SIZE)}
        return Layout(
            "glm45", GLM45_FIRST_SPECIAL_ID, specials, frozenset(GLM45_NOT_SPECIAL), GLM45_CHAT_TEMPLATE,
            eos="<|endoftext|>", pad="<|endoftext|>", generation_eos=(151329, 151336, 151338),
            model_max_length=131_072,
        )  # fmt: skip
    if family == "plain":
        return Layout(
            "plain", QWEN3_FIRST_SPECIAL_ID, {i: t for t, i in PLAIN_SPECIALS.items()},
            frozenset(QWEN3_NOT_SPECIAL & set(PLAIN_SPECIALS)), PLAIN_CHAT_TEMPLATE, eos="<|im_end|>",
            pad="<|endoftext|>", generation_eos=(151645, 151643), generation_bos=151643, model_max_length=32_768,
        )  # fmt: skip
    if family == "harmony":
        by_id = {i: t for t, i in HARMONY_SPECIALS.items()}
        specials = {i: by_id.get(i, f"<|reserved_{i}|>") for i in range(HARMONY_FIRST_SPECIAL_ID, HARMONY_VOCAB_SIZE)}
        return Layout(
            "harmony", HARMONY_FIRST_SPECIAL_ID, specials, frozenset(), HARMONY_CHAT_TEMPLATE,
            eos="<|return|>", bos="<|startoftext|>", pad="<|endoftext|>",
            generation_eos=(200002, 199999, 200012), generation_bos=199998, pinned=dict(HARMONY_WORDS),
            model_max_length=131_072,
        )  # fmt: skip
    raise ValueError(f"no test tokenizer for family {family!r}: use one of {', '.join(FAMILIES)}")


#: Families :func:`build_test_tokenizer` can build (``plain``: ChatML without reasoning tokens).
FAMILIES: tuple[str, ...] = ("kimi", "qwen3", "qwen3-thinking", "deepseek", "glm45", "harmony", "plain")
