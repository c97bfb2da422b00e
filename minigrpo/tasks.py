"""What a task is: data rows with a `prompt` column, and the reward functions that score completions.

A reward function follows TRL's signature, so reward code moves between the two unchanged:
`fn(prompts, completions, completion_ids, **columns) -> list[float]`, called with keywords, where
`columns` are the data's other fields, one value per completion.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

RewardFn = Callable[..., list[float]]


@dataclass
class Task:
    name: str
    description: str  # one line for `minigrpo tasks`
    make_data: Callable[[str, int], list[dict]]  # (split, seed) -> rows with a "prompt" column
    rewards: list[RewardFn]
    weights: list[float] | None = None  # one per reward; None: all 1.0
    reward_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reward_names = self.reward_names or [fn.__name__ for fn in self.rewards]


def get_task(name: str) -> Task:
    from rewards import TASKS

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the built-in tasks are: {', '.join(TASKS)}")
    return TASKS[name]


def score(task: Task, weights: list[float], prompts: list[str], completions: list[str],
          completion_ids: list[list[int]], rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """Run every reward function on one batch; the weighted total per completion, and each part."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    parts = {}
    for name, fn in zip(task.reward_names, task.rewards):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as error:
            where = inspect.getsourcefile(fn) or "?"
            raise RuntimeError(f"reward function {name} ({where}) raised {type(error).__name__}: {error}") from error
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise RuntimeError(f"reward function {name} returned {len(values)} values for "
                               f"{len(completions)} completions; it must return one per completion")
        bad = [v for v in values if not isinstance(v, (int, float)) or v != v or abs(v) == float("inf")]
        if bad:
            raise RuntimeError(f"reward function {name} returned {bad[0]!r}; each value must be a finite number")
        parts[name] = [float(v) for v in values]
    totals = [sum(w * parts[name][i] for w, name in zip(weights, task.reward_names)) for i in range(len(completions))]
    return totals, parts
