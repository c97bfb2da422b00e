"""Multiply two three-digit numbers, where a tool is the only sure way to the answer.

The model is offered `multiply`; a small model cannot multiply 347 by 892 in its head, so the reward (the
exact product in its last turn) rewards calling the tool and reading its result back. Each prompt opens with
one worked exchange (a question, the call, the tool's reply, the answer): a model whose chat template offers no
tools (SmolLM2) does not call one from the schema alone, and learns nothing from a reward that is always 0; shown
one exchange, it writes calls of its own.

>>> multiply(347, 892)
309524
>>> product_reward([[{"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": '
...                   '{"a": 347, "b": 892}}</tool_call>'}, {"role": "tool", "content": "309524"},
...                  {"role": "assistant", "content": "347 x 892 = 309524."}]], a=[347], b=[892])
[1.0]
>>> product_reward([[{"role": "assistant", "content": "About 300000."}]], a=[347], b=[892])
[0.0]

A second reward, `called_multiply` (weight 0.2), is 1.0 for an episode that calls the tool on the question's two
numbers, whatever it answers after: an untrained small model makes that call in few of its episodes and reads the
result back in fewer, so without it most groups score all 0 and GRPO has nothing to compare. The product still
decides: a call and a wrong answer score 0.2, a right answer without a call 1.0, both 1.2.

>>> called_multiply([[{"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": '
...                    '{"a": 347, "b": 892}}</tool_call>'}, {"role": "tool", "content": "309524"},
...                   {"role": "assistant", "content": "Then 5."}], "347 x 892 = 309524."], a=[347, 347], b=[892, 892])
[1.0, 0.0]
"""

from __future__ import annotations

import random
import re

from minigrpo.scoring import text_of
from minigrpo.tools import parse_calls
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


def called_multiply(completions: list, a: list[int], b: list[int], **kwargs) -> list[float]:
    """1.0 when one of the model's turns calls `multiply` on the question's a and b (in either order), else 0.0."""
    scores = []
    for episode, x, y in zip(completions, a, b):
        turns = [m["content"] for m in episode if m["role"] == "assistant"] if isinstance(episode, list) else [episode]
        calls = [call for turn in turns for call in parse_calls(turn) if not call.error and call.name == "multiply"]
        scores.append(1.0 if any(sorted(c.arguments.values(), key=str) == sorted([x, y], key=str) for c in calls)
                      else 0.0)
    return scores


def final_product(episode) -> str | None:
    """The answer a majority vote counts: the last number of the episode's last message, commas dropped."""
    found = NUMBER.findall(text_of(episode))
    return found[-1].replace(",", "") if found else None


def question(a: int, b: int) -> str:
    return f"What is {a} x {b}? Use the multiply tool, then give the product."


# the exchange every prompt opens with: the call as the tools' system message describes it, and the answer read back
WORKED = [{"role": "user", "content": question(214, 367)},
          {"role": "assistant", "content": '<tool_call>\n{"name": "multiply", "arguments": {"a": 214, "b": 367}}\n'
                                           '</tool_call>'},
          {"role": "tool", "content": str(multiply(214, 367))},
          {"role": "assistant", "content": f"The product is {multiply(214, 367)}."}]


def make_data(split: str, seed: int) -> list[dict]:
    rng = random.Random(f"multiply-{split}-{seed}")
    rows = []
    for _ in range(200 if split == "train" else 64):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": [*WORKED, {"role": "user", "content": question(a, b)}], "a": a, "b": b})
    return rows


TASK = Task(
    name="multiply",
    description="tool use: three-digit products, with a multiply tool as the only sure way to the answer",
    make_data=make_data,
    rewards=[product_reward, called_multiply],
    weights=[1.0, 0.2],
    answer=final_product,
    tools=[multiply],
    examples=[{"prompt": "What is 12 x 34?", "a": 12, "b": 34, "expected": 1.0,
               "completion": [{"role": "assistant", "content": "12 x 34 = 408"}]}],
)
