"""Grade-school math word problems (GSM8K): a numeric answer, extracted two ways, both logged.

- strict: the number inside the one <answer> tag (commas and a $ sign allowed) equals the answer;
- lenient: the last number anywhere in the reply does. The strict one trains (weight 1); the lenient one
  is logged only (weight 0): a gap between them means the model knows the answer but not the format.

>>> gsm8k_strict(["<think>6 * 9</think><answer>54</answer>"], answer=["6 * 9 = 54\\n#### 54"])
[1.0]
>>> gsm8k_strict(["It is 54."], answer=["#### 54"]), gsm8k_lenient(["It is 54."], answer=["#### 54"])
([0.0], [1.0])
>>> gsm8k_strict(["<answer>$1,250.00</answer>"], answer=["#### 1250"])
[1.0]

The data come from the hub (openai/gsm8k) when it is reachable and `datasets` is installed; otherwise,
and in tests, from a small bundled sample of problems in the same format.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from minigrpo.scoring import text_of
from minigrpo.tasks import Task, split_rows

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
PROMPT = ("{question}\nThink step by step inside <think> </think>, then give only the final number "
          "inside <answer> </answer>.")


def to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def gold(answer: str) -> float:
    """GSM8K solutions end with '#### <number>'."""
    return to_number(answer.split("####")[-1].strip())


def gsm8k_strict(completions: list, answer: list[str], **kwargs) -> list[float]:
    scores = []
    for completion, solution in zip(completions, answer):
        tags = ANSWER.findall(text_of(completion))
        value = to_number(tags[0].strip()) if len(tags) == 1 else None
        scores.append(1.0 if value is not None and abs(value - gold(solution)) < 1e-6 else 0.0)
    return scores


def gsm8k_lenient(completions: list, answer: list[str], **kwargs) -> list[float]:
    scores = []
    for completion, solution in zip(completions, answer):
        numbers = NUMBER.findall(text_of(completion))
        value = to_number(numbers[-1]) if numbers else None
        scores.append(1.0 if value is not None and abs(value - gold(solution)) < 1e-6 else 0.0)
    return scores


def final_number(completion) -> str | None:
    """The answer a majority vote counts: the last number of the reply, commas and dollar signs dropped."""
    numbers = NUMBER.findall(text_of(completion))
    value = to_number(numbers[-1]) if numbers else None
    return None if value is None else f"{value:g}"


def make_data(split: str, seed: int) -> list[dict]:
    rows = None
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            import datasets

            rows = datasets.load_dataset("openai/gsm8k", "main", split=split).to_list()
        except Exception:
            rows = None  # no `datasets`, or no hub: the bundled sample
    if rows is None:
        rows = split_rows([json.loads(line) for line in SAMPLE.read_text().splitlines()], split, seed)
    return [{"prompt": PROMPT.format(question=r["question"]), **r} for r in rows]


TASK = Task(
    name="gsm8k",
    description="grade-school word problems; strict (<answer> tag) and lenient (last number) scoring",
    make_data=make_data,
    rewards=[gsm8k_strict, gsm8k_lenient],
    answer=final_number,
    weights=[1.0, 0.0],
    examples=[
        {"prompt": "2 + 2?", "answer": "#### 4", "completion": "<think>2+2</think><answer>4</answer>", "expected": 1.0},
        {"prompt": "2 + 2?", "answer": "#### 4", "completion": "It is 4", "expected": 0.0},
    ],
)
