"""Countdown (as TinyZero defines it): combine 3-4 numbers with + - * / to hit a target.

Scored as TinyZero scores it, so curves compare with published ones: the last <answer>...</answer> on the
completion's last line is the answer (none: 0.0); 1.0 when it is an expression of digits, + - * / and
parentheses only, uses every given number exactly once, and equals the target; 0.1 for any other answer,
an empty one or one with "= 20" included. The expression is computed by a bounded evaluator, not `eval`
(so `**` is refused where TinyZero would compute it). `countdown_reward_lenient` also takes "... = 20" and
an answer anywhere in the text.

>>> countdown_reward(["<think>..</think><answer>(7 - 3) * 5</answer>"], target=[20], nums=[[3, 5, 7]])
[1.0]
>>> countdown_reward(["<answer>7 * 5 - 3</answer>"], target=[20], nums=[[3, 5, 7]])  # equals 32
[0.1]
>>> countdown_reward(["<answer>4 * 5</answer>"], target=[20], nums=[[3, 5, 7]])  # not the given numbers
[0.1]
>>> countdown_reward(["<answer>(7 - 3) * 5 = 20</answer>"], target=[20], nums=[[3, 5, 7]])
[0.1]
>>> countdown_reward_lenient(["<answer>(7 - 3) * 5 = 20</answer>"], target=[20], nums=[[3, 5, 7]])
[1.0]
>>> countdown_reward(["I think it is 20."], target=[20], nums=[[3, 5, 7]])
[0.0]
"""

from __future__ import annotations

import ast
import random
import re

from minigrpo.scoring import text_of
from minigrpo.tasks import Task

ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")  # TinyZero's characters
FORMAT_SCORE = 0.1  # TinyZero's score for an answer in the right place that is not right
MAX_CHARS = 200  # an honest equation of four two-digit numbers is ~20 characters
MAX_NODES = 40  # operators and numbers in the parsed tree
MAX_DIGITS = 6  # no literal longer than this is a countdown number


def evaluate(expression: str) -> tuple[float, list[int]] | None:
    """The value of an arithmetic expression and the numbers it uses, or None if it is not one.

    Only integer literals, + - * / and parentheses are allowed, and the size is bounded before
    anything is computed, so hostile strings cannot run code, hang, or exhaust memory.

    >>> evaluate("(7 - 3) * 5")
    (20.0, [3, 5, 7])
    >>> evaluate("__import__('os')") is None, evaluate("9**9**9") is None, evaluate("1/0") is None
    (True, True, True)
    """
    if len(expression) > MAX_CHARS or expression.count("(") > MAX_NODES:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = list(ast.walk(tree))
    if len(nodes) > 2 * MAX_NODES:
        return None
    numbers = []
    for node in nodes:
        if isinstance(node, ast.Constant):
            if type(node.value) is not int or len(str(node.value)) > MAX_DIGITS:
                return None
            numbers.append(node.value)
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult,
                                   ast.Div, ast.USub, ast.UAdd)):
            return None
    try:
        value = _compute(tree.body)
    except (ZeroDivisionError, OverflowError, RecursionError):
        return None
    return float(value), sorted(numbers)


def _compute(node: ast.AST) -> float:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        value = _compute(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    left, right = _compute(node.left), _compute(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right


def last_answer(text: str) -> str | None:
    """The last <answer>...</answer> of `text`, stripped, as `re.finditer` finds them left to right; in
    linear time (a lazy regex takes quadratic time on many unclosed tags)."""
    found, at = None, 0
    while (start := text.find("<answer>", at)) >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, at = text[start + len("<answer>"):end].strip(), end + len("</answer>")
    return found


def score(completion: str, target: int, nums: list[int], lenient: bool = False) -> float:
    answer = last_answer(completion if lenient else completion.split("\n")[-1])
    if answer is None:
        return 0.0
    if len(answer) > MAX_CHARS:
        return FORMAT_SCORE
    if lenient:
        answer = answer.split("=")[0]  # "(7 - 3) * 5 = 20" counts as its left side
    if sorted(int(n) for n in re.findall(r"\d+", answer)) != sorted(nums) or not ALLOWED.match(answer):
        return FORMAT_SCORE
    result = evaluate(answer)
    return 1.0 if result is not None and abs(result[0] - target) < 1e-5 else FORMAT_SCORE


def countdown_reward(completions: list, target: list[int], nums: list[list[int]], **kwargs) -> list[float]:
    """TRL's reward signature: one float per completion; `target` and `nums` are dataset columns."""
    return [score(text_of(c), t, n) for c, t, n in zip(completions, target, nums)]


def countdown_reward_lenient(completions: list, target: list[int], nums: list[list[int]], **kwargs) -> list[float]:
    """As countdown_reward, but an answer anywhere counts and a trailing "= target" is allowed."""
    return [score(text_of(c), t, n, lenient=True) for c, t, n in zip(completions, target, nums)]


PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number must be used exactly once. Show your work in <think> </think> "
    "tags, and return the final equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


def make_problem(rng: random.Random) -> dict:
    """A solvable problem: random numbers combined by random operations, the result as the target."""
    while True:
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        order = rng.sample(nums, len(nums))
        value = order[0]
        for n in order[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (n == 0 or value % n):
                op = "+"
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n if op == "/" else 0}[op]
        if 1 <= value <= 999:
            return {"prompt": PROMPT.format(nums=nums, target=value), "target": value, "nums": nums}


def make_data(split: str, seed: int) -> list[dict]:
    """A seeded set of problems; the test split uses a disjoint seed stream."""
    rng = random.Random(f"countdown-{split}-{seed}")
    return [make_problem(rng) for _ in range(10_000 if split == "train" else 256)]


TASK = Task(
    name="countdown",
    description="reach a target with 3-4 numbers and + - * / (TinyZero); hard for models under ~1B",
    make_data=make_data,
    rewards=[countdown_reward],
    examples=[{"prompt": PROMPT.format(nums=[3, 5, 2], target=16), "target": 16, "nums": [3, 5, 2],
               "completion": "<think>3 + 5 is 8, times 2 is 16</think>\n<answer> (3 + 5) * 2 </answer>",
               "expected": 1.0},
              {"prompt": PROMPT.format(nums=[7, 4, 9], target=19), "target": 19, "nums": [7, 4, 9],
               "completion": "<think>7 + 4 + 9</think>\n<answer> 7 + 4 * 9 </answer>", "expected": 0.1},
              {"prompt": PROMPT.format(nums=[6, 8, 3], target=17), "target": 17, "nums": [6, 8, 3],
               "completion": "<think>6 + 8 is 14, plus 3</think>\n<answer> 6 + 8 + 3 </answer>", "expected": 1.0}],
)
