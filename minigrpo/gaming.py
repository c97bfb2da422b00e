"""Cheap ways to game a reward, tried before a run spends hours finding them (`minigrpo check-reward`).

Each of the task's right worked examples (those scoring the highest expected total) is scored beside completions a
policy could learn to write instead of solving the task: nothing, another prompt's right answer (one answer for
every prompt), the right completion with its numbers taken out (the format alone), the prompt said back, and the
right answer buried in filler (length). A wrong one paid as much as the right completion in total, or the padded
one paid more, is reported with the reward functions that pay it: the task can be gamed that way.

    >>> from minigrpo.tasks import Task
    >>> def any_number(completions, **kw):
    ...     return [float(any(ch.isdigit() for ch in c)) for c in completions]
    >>> task = Task("t", "", lambda s, seed: [], [any_number],
    ...             examples=[{"prompt": "2 + 2?", "completion": "4"}, {"prompt": "3 + 4?", "completion": "7"}])
    >>> for found in gamed(task):
    ...     print(found)
    the prompt said back is paid 1.00 in total, as much as the right completion (1.00; worked example 0), by any_number
    another prompt's answer is paid 1.00 in total, as much as the right completion (1.00; worked example 0), by any_number
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minigrpo.scoring import score
from minigrpo.tasks import Task

FILLER = " Let me think about this step by step and check it once more." * 40  # about 2,500 characters


@dataclass
class Gamed:
    probe: str  # which gaming completion
    paid: float  # the total it was paid
    right: float  # the total the right completion was paid
    example: int  # the worked example's index
    rewards: list[str]  # the reward functions that pay it

    def __str__(self) -> str:
        than = "more than" if self.probe == PADDED else "as much as"
        return (f"{self.probe} is paid {self.paid:.2f} in total, {than} the right completion ({self.right:.2f}; "
                f"worked example {self.example}), by {', '.join(self.rewards)}")


PADDED = "the answer buried in filler"  # still right: gamed only where it is paid more


def probes(example: dict, others: list[dict]) -> dict[str, str]:
    """The gaming completions for one right worked example, by what they try."""
    right = example["completion"]
    other = next((o["completion"] for o in others if o["completion"] != right), None)
    tried = {"nothing": "", "the format alone (its numbers taken out)": re.sub(r"\d+(?:\.\d+)?", "", right),
             "the prompt said back": str(example["prompt"]), PADDED: right + FILLER}
    if other is not None:
        tried["another prompt's answer"] = other
    return tried


def gamed(task: Task) -> list[Gamed]:
    """Each gaming completion the task's rewards pay as much as a right one (the padded one: more), on the first
    right worked example where they do. Text completions only: an episode task's completions are conversations."""
    if task.tools or task.environment or not task.examples or not all(isinstance(e["completion"], str)
                                                                      for e in task.examples):
        return []
    best = max(e.get("expected", 1.0) for e in task.examples)
    right = [(i, e) for i, e in enumerate(task.examples) if e.get("expected", best) == best]
    found: dict[str, Gamed] = {}
    for i, example in right:
        row = {k: v for k, v in example.items() if k not in ("completion", "expected")}
        tried = {"right": example["completion"], **probes(example, [e for _, e in right])}
        result = score(task.rewards, task.weights, [row["prompt"]] * len(tried), list(tried.values()),
                       [[] for _ in tried], [row] * len(tried))
        totals = result.totals
        for k, probe in enumerate(tried):
            if probe == "right" or probe in found or totals[0] <= 0 or tried[probe] == tried["right"]:
                continue
            if totals[k] > totals[0] + 1e-9 or (probe != PADDED and totals[k] >= totals[0] - 1e-9):
                payers = [name for name, values in result.values.items() if (values[k] or 0.0) > 0
                          and (values[k] or 0.0) >= (values[0] or 0.0) - 1e-9]
                found[probe] = Gamed(probe, totals[k], totals[0], i, payers or list(result.values))
    return list(found.values())
