"""The built-in text the test tokenizer is trained on, and a deterministic text generator.

Written for this project (no third-party text): mixed prose, arithmetic, code and a little Chinese, so
the byte-level BPE learns merges for the kinds of strings prompts contain. The generator reuses the
corpus' words so synthetic prompts tokenize at a realistic ~1 token per word.
"""

from __future__ import annotations

import random

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

_WORDS = sorted(set(CORPUS.split()))


def synthetic_text(n_words: int, seed: int) -> str:
    """``n_words`` corpus words in a deterministic random order (lines every ~14 words)."""
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=n_words)
    for i in range(13, n_words, 14):
        words[i] += "\n"
    return " ".join(words)
