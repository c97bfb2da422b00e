"""Multiply two three-digit numbers, where a tool is the only sure way to the answer.

The model is offered `multiply`; a small model cannot multiply 347 by 892 in its head, so the reward (the
exact product in its last turn) rewards calling the tool and reading its result back.

>>> multiply(347, 892)
309524
>>> product_reward([[{"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": '
...                   '{"a": 347, "b": 892}}</tool_call>'}, {"role": "tool", "content": "309524"},
...                  {"role": "assistant", "content": "347 x 892 = 309524."}]], a=[347], b=[892])
[1.0]
>>> product_reward([[{"role": "assistant", "content": "About 300000."}]], a=[347], b=[892])
[0.0]
"""

from __future__ import annotations

import random
import re

from minigrpo.scoring import text_of
from minigrpo.tasks import Task

NUMBER = re.compile(r"\d[\d,]*")


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def product_reward(completions: list, a: list[int], b: list[int], **kwargs) -> list[float]:
    """1.0 when the last number of the model's last turn is a x b (commas allowed), else 0.0."""
    scores = []
    for episode, x, y in zip(completions, a, b):
        found = NUMBER.findall(text_of(episode))
        scores.append(1.0 if found and int(found[-1].replace(",", "")) == x * y else 0.0)
    return scores


def final_product(episode) -> str | None:
    """The answer a majority vote counts: the last number of the episode's last message, commas dropped."""
    found = NUMBER.findall(text_of(episode))
    return found[-1].replace(",", "") if found else None


def make_data(split: str, seed: int) -> list[dict]:
    rng = random.Random(f"multiply-{split}-{seed}")
    rows = []
    for _ in range(200 if split == "train" else 64):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": f"What is {a} x {b}? Use the multiply tool, then give the product.", "a": a, "b": b})
    return rows


TASK = Task(
    name="multiply",
    description="tool use: three-digit products, with a multiply tool as the only sure way to the answer",
    make_data=make_data,
    rewards=[product_reward],
    answer=final_product,
    tools=[multiply],
    examples=[{"prompt": "What is 12 x 34?", "a": 12, "b": 34, "expected": 1.0,
               "completion": [{"role": "assistant", "content": "12 x 34 = 408"}]}],
)
