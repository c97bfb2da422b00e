"""Think/answer structure: reasoning in <think>, then exactly one non-empty <answer>.

A grader of structure only: add it beside a reward that checks the answer's content, never alone, or the
model learns to fill tags with anything.

>>> format_reward(["<think>7 - 3 = 4</think> <answer>4</answer>"])
[1.0]
>>> format_reward(["<answer>4</answer>"])  # an answer without reasoning
[0.5]
>>> format_reward(["<think>hmm</think><answer>  </answer>"])  # empty answer
[0.0]
>>> format_reward(["<answer>4</answer><answer>5</answer>"])  # two answers: which one counts?
[0.0]
>>> format_reward(["<answer>4</answer><think>late</think>"])  # reasoning after the answer
[0.0]
"""

from __future__ import annotations

import re

from minigrpo.scoring import text_of

THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_score(text: str) -> float:
    answers = ANSWER.findall(text)
    if len(answers) != 1 or not answers[0].strip() or text.count("<answer>") != 1:
        return 0.0
    thinks = THINK.findall(text)
    if not thinks:
        return 0.5
    if len(thinks) > 1 or not thinks[0].strip() or text.index("</think>") > text.index("<answer>"):
        return 0.0
    return 1.0


def format_reward(completions: list[str], **kwargs) -> list[float]:
    """1.0 for one non-empty <think> block followed by one non-empty <answer>; 0.5 for the answer alone."""
    return [format_score(text_of(c)) for c in completions]
