"""Competition math (MATH): answers compared for mathematical equivalence with `math-verify`, so
"\\frac{1}{2}", "0.5" and "1/2" all count, not by string equality.

>>> math_reward(["The answer is $\\\\boxed{\\\\frac{1}{2}}$."], solution=["$0.5$"])
[1.0]
>>> math_reward(["<answer>$\\\\frac{\\\\sqrt{2}}{2}$</answer>"], solution=["$\\\\frac{1}{\\\\sqrt{2}}$"])
[1.0]
>>> math_reward(["I get 3."], solution=["$4$"])
[0.0]
"""

from __future__ import annotations

import os

from minigrpo.scoring import text_of
from minigrpo.tasks import Task, split_rows

PROMPT = "{problem}\nReason step by step, then put the final answer in \\boxed{{}}."

# a small bundled sample for offline runs and tests: (problem, answer in LaTeX)
SAMPLE = [
    ("What is $\\frac{3}{4} - \\frac{1}{4}$?", "\\frac{1}{2}"),
    ("Solve for $x$: $2x + 6 = 14$.", "4"),
    ("What is $\\sqrt{49} + \\sqrt{16}$?", "11"),
    ("Compute $3^4$.", "81"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
    ("Simplify $\\frac{\\sqrt{8}}{2}$.", "\\sqrt{2}"),
    ("What is $15\\%$ of $80$?", "12"),
    ("Find the slope of the line through $(1, 2)$ and $(3, 8)$.", "3"),
    ("What is the least common multiple of $6$ and $8$?", "24"),
    ("Solve $x^2 = 25$ for $x > 0$.", "5"),
    ("What is $\\frac{2}{3} \\cdot \\frac{9}{4}$?", "\\frac{3}{2}"),
    ("How many positive divisors does $12$ have?", "6"),
    ("What is the area of a circle of radius $3$?", "9\\pi"),
    ("Evaluate $\\log_2 32$.", "5"),
    ("What is $0.2 + \\frac{3}{10}$?", "\\frac{1}{2}"),
    ("A right triangle has legs $6$ and $8$. How long is its hypotenuse?", "10"),
    ("What is $7!/5!$?", "42"),
    ("What is the remainder when $100$ is divided by $7$?", "2"),
    ("Simplify $(x+1)^2 - (x-1)^2$.", "4x"),
    ("What is $\\frac{1}{2} + \\frac{1}{3}$?", "\\frac{5}{6}"),
]


def math_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's final answer is mathematically equivalent to the solution's."""
    from math_verify import parse, verify

    scores = []
    for completion, gold in zip(completions, solution):
        text = text_of(completion)
        try:
            answer = parse(text)
            scores.append(1.0 if answer and verify(parse(gold), answer) else 0.0)
        except Exception:  # a reply math-verify cannot read is a wrong reply, not a broken reward
            scores.append(0.0)
    return scores


def make_data(split: str, seed: int) -> list[dict]:
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            import datasets

            rows = datasets.load_dataset("HuggingFaceH4/MATH-500", split="test").to_list()
            rows = [{"problem": r["problem"], "solution": f"${r['answer']}$"} for r in rows]
            return [{"prompt": PROMPT.format(problem=r["problem"]), **r} for r in split_rows(rows, split, seed)]
        except Exception:
            pass  # no `datasets`, or no hub: the bundled sample
    rows = [{"problem": p, "solution": f"${a}$"} for p, a in SAMPLE]
    return [{"prompt": PROMPT.format(problem=r["problem"]), **r} for r in split_rows(rows, split, seed)]


TASK = Task(
    name="math",
    description="competition math; answers checked for equivalence with math-verify",
    make_data=make_data,
    rewards=[math_reward],
    # a prompt that is not itself an expression of its answer: `check-reward` tries the prompt said back as a
    # completion, and "1/2 + 1/2" would rightly be paid as 1
    examples=[{"prompt": "What is 3 squared?", "solution": "$9$", "completion": "so \\boxed{9}", "expected": 1.0}],
)
