"""Write a Python function; graded by running it on held-back tests in the sandbox (minigrpo.sandbox).

The tests never enter the process that runs the model's code: only their arguments do, and the results
are compared outside. The reward is the share of tests passed, so a partly right function still gives
the group spread to learn from.

>>> code_reward(["```python\\ndef double(x):\\n    return 2 * x\\n```"], function=["double"],
...             tests=[[[[1], 2], [[5], 10]]])
[1.0]
>>> code_reward(["def double(x): return x + 2"], function=["double"], tests=[[[[1], 2], [[5], 10]]])
[0.0]
>>> code_reward(["```python\\nimport os\\nos._exit(0)\\n```"], function=["double"], tests=[[[[1], 2]]])
[0.0]
"""

from __future__ import annotations

import re

from minigrpo.sandbox import run_tests
from minigrpo.scoring import text_of
from minigrpo.tasks import Task, split_rows

CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
PROMPT = ("Write a Python function `{signature}` that {spec} Reply with the function in one "
          "```python code block, with no example usage.")

# (function, signature, what it does, tests as [arguments, expected result])
PROBLEMS = [
    ("add", "add(a, b)", "returns the sum of two integers.", [[[2, 3], 5], [[-1, 1], 0], [[10, 32], 42]]),
    ("reverse", "reverse(s)", "returns the string s reversed.", [[["abc"], "cba"], [[""], ""], [["ab c"], "c ba"]]),
    ("is_palindrome", "is_palindrome(s)", "returns True if the string s reads the same backwards, else False.",
     [[["level"], True], [["abca"], False], [[""], True], [["aa"], True]]),
    ("largest", "largest(xs)", "returns the largest number in the non-empty list xs.",
     [[[[3, 9, 2]], 9], [[[-5, -2]], -2], [[[7]], 7]]),
    ("count_vowels", "count_vowels(s)", "returns how many of the characters of s are vowels (a, e, i, o, u; any case).",
     [[["hello"], 2], [["AEIOU"], 5], [["xyz"], 0]]),
    ("factorial", "factorial(n)", "returns n! for an integer n >= 0.", [[[0], 1], [[5], 120], [[10], 3628800]]),
    ("fibonacci", "fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1.",
     [[[0], 0], [[1], 1], [[10], 55], [[20], 6765]]),
    ("sum_evens", "sum_evens(xs)", "returns the sum of the even numbers in the list xs.",
     [[[[1, 2, 3, 4]], 6], [[[]], 0], [[[-2, 5]], -2]]),
    ("gcd", "gcd(a, b)", "returns the greatest common divisor of two positive integers.",
     [[[12, 18], 6], [[7, 13], 1], [[100, 75], 25]]),
    ("second_largest", "second_largest(xs)", "returns the second largest distinct value in xs (at least two distinct).",
     [[[[1, 5, 3]], 3], [[[4, 4, 2]], 2], [[[-1, -7]], -7]]),
    ("word_count", "word_count(s)", "returns the number of whitespace-separated words in s.",
     [[["a b  c"], 3], [[""], 0], [["one"], 1]]),
    ("clamp", "clamp(x, lo, hi)", "returns x limited to the range [lo, hi].",
     [[[5, 0, 10], 5], [[-3, 0, 10], 0], [[12, 0, 10], 10]]),
]


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole reply when there is none."""
    blocks = CODE.findall(text)
    return blocks[-1] if blocks else text


def code_reward(completions: list, function: list[str], tests: list[list], **kwargs) -> list[float]:
    """The share of tests the completion's function passes, run in the sandbox."""
    scores = []
    for completion, name, cases in zip(completions, function, tests):
        text = text_of(completion)
        verdict = run_tests(extract_code(text), name, [(args, expected) for args, expected in cases], timeout=5.0)
        scores.append(verdict.fraction)
    return scores


def make_data(split: str, seed: int) -> list[dict]:
    rows = [{"prompt": PROMPT.format(signature=sig, spec=spec), "function": name, "tests": tests}
            for name, sig, spec, tests in PROBLEMS]
    return split_rows(rows, split, seed)  # the held-out problem is never trained on


TASK = Task(
    name="code",
    description="write a small Python function; graded on held-back tests in a sandbox",
    make_data=make_data,
    rewards=[code_reward],
    runs_code=True,
    examples=[{"prompt": "add", "function": "add", "tests": [[[1, 2], 3]],
               "completion": "```python\ndef add(a, b):\n    return a + b\n```", "expected": 1.0}],
)
