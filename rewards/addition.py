"""Addition of two one-digit numbers, scored on the last integer of the reply.

Small enough that a 135M model learns it in a few dozen steps on a laptop cpu: SmolLM2-135M-Instruct
gets it right in roughly a quarter of its samples before training, so groups have spread from step 1.

>>> addition_reward(["3 + 4 is 7."], a=[3], b=[4])
[1.0]
>>> addition_reward(["The answer is 8"], a=[3], b=[4])
[0.0]
>>> addition_reward(["I am not sure."], a=[3], b=[4])
[0.0]
"""

from __future__ import annotations

import random
import re

from minigrpo.scoring import text_of
from minigrpo.tasks import Task

INTEGER = re.compile(r"-?\d+")


def addition_reward(completions: list[str], a: list[int], b: list[int], **kwargs) -> list[float]:
    """1.0 when the last integer in the completion is a + b, else 0.0."""
    scores = []
    for completion, x, y in zip(completions, a, b):
        found = INTEGER.findall(text_of(completion))
        scores.append(1.0 if found and int(found[-1]) == x + y else 0.0)
    return scores


def last_integer(completion) -> str | None:
    """The answer a majority vote counts: the last integer of the reply."""
    found = INTEGER.findall(text_of(completion))
    return str(int(found[-1])) if found else None


def make_data(split: str, seed: int) -> list[dict]:
    """All 100 one-digit pairs, three phrasings each; the test split holds a quarter of the pairs out."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(f"addition-{seed}").shuffle(pairs)
    chosen = pairs[25:] if split == "train" else pairs[:25]
    phrasings = ["What is {a} + {b}?", "Compute {a} plus {b}.", "Add {a} and {b}."]
    return [{"prompt": p.format(a=a, b=b), "a": a, "b": b} for a, b in chosen for p in phrasings]


TASK = Task(
    name="addition",
    description="one-digit addition, scored on the last number of the reply; learnable by a 135M model on cpu",
    make_data=make_data,
    rewards=[addition_reward],
    answer=last_integer,
    examples=[{"prompt": "What is 3 + 4?", "a": 3, "b": 4, "completion": "3 + 4 is 7.", "expected": 1.0},
              {"prompt": "Add 2 and 6.", "a": 2, "b": 6, "completion": "The answer is 8.", "expected": 1.0},
              {"prompt": "Compute 5 plus 1.", "a": 5, "b": 1, "completion": "I am not sure.", "expected": 0.0}],
)
