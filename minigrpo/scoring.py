"""Calling reward functions: one contract, checked on every call, with errors that name the culprit.

The contract is TRL's, so reward code moves between the two unchanged:

    fn(prompts, completions, completion_ids, **columns) -> list[float | dict[str, float] | None]

called with keywords, one value per completion. `columns` are the data's other fields, one value per
completion. `None` means "does not apply here" and is left out of that function's mean (it adds 0 to the
total). A dict holds named parts: they are summed, and each is logged as `reward/<fn>/<part>/mean`.
Chat-format prompts (lists of messages) get chat-format completions: `[{"role": "assistant", ...}]`.
`async def` reward functions are awaited.

For hobby rewards that score one completion at a time, `@per_sample` turns

    @per_sample
    def short(completion: str, **example) -> float:
        return 1.0 if len(completion) < 200 else 0.0

into that contract (a dict return gives parts too).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

RESERVED = {"prompts", "completions", "completion_ids"}


class RewardError(RuntimeError):
    """A reward function broke the contract: which function, and why."""


def per_sample(fn: Callable) -> Callable:
    """Lift `fn(completion: str, **example) -> float | dict | None` to the batch contract."""

    @functools.wraps(fn)
    def batch(prompts, completions, completion_ids=None, **columns):
        out = []
        for i, completion in enumerate(completions):
            example = {key: values[i] for key, values in columns.items()}
            out.append(fn(text_of(completion), prompt=prompts[i], **example))
        return out

    batch.per_sample = fn
    return batch


def text_of(completion) -> str:
    """A completion's text, whether it came as a string or in chat format (a list of messages)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def reward_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def required_columns(fn: Callable) -> list[str]:
    """The data columns a reward function names in its signature (beyond the reserved arguments)."""
    target = getattr(fn, "per_sample", fn)
    skip = RESERVED | ({"completion", "prompt"} if target is not fn else set())
    params = inspect.signature(target).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty and p.name not in skip]


@dataclass
class Scores:
    totals: list[float]  # [B] weighted sum over functions (None counts 0)
    values: dict[str, list[float | None]]  # function -> [B], None where it does not apply
    parts: dict[str, list[float]] = field(default_factory=dict)  # "fn/part" -> [B] for dict-valued rewards
    errors: dict[str, int] = field(default_factory=dict)  # function -> samples that raised and scored 0


def call_reward(fn: Callable, kwargs: dict, n: int) -> list:
    """One call under the contract; raises RewardError for the wrong length or a value that is no number."""
    values = fn(**kwargs)
    if inspect.isawaitable(values):
        values = asyncio.run(_await(values))
    name = reward_name(fn)
    if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward function {name} returned {type(values).__name__}; "
                          f"it must return a list with one value per completion")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions; "
                          f"it must return one per completion")
    for i, value in enumerate(values):
        for v in (value.values() if isinstance(value, dict) else [value]):
            if v is None and not isinstance(value, dict):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"reward function {name} returned {value!r} for completion {i}; "
                                  f"each value must be a finite number, a dict of them, or None")
    return values


async def _await(awaitable):
    return await awaitable


def score(reward_fns: list[Callable], weights: list[float], prompts: list, completions: list,
          completion_ids: list[list[int]], rows: list[dict], strict: bool = False) -> Scores:
    """Every reward function on one batch. A function that raises scores 0 on the samples it fails on
    (with a warning and a counter), unless `strict`; a broken contract is always a RewardError."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    n = len(completions)
    result = Scores(totals=[0.0] * n, values={})
    for fn, weight in zip(reward_fns, weights):
        name = reward_name(fn)
        missing = [c for c in required_columns(fn) if c not in columns]
        if missing:
            raise RewardError(f"reward function {name} needs the column(s) {missing}, which the data does not "
                              f"have; it has: {sorted(columns) or 'only prompt'}")
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        try:
            values = call_reward(fn, kwargs, n)
        except RewardError:
            raise
        except Exception as error:
            if getattr(error, "fatal", False):  # the machine cannot run this reward (e.g. SandboxError)
                raise
            if strict:
                raise RewardError(f"reward function {name} raised {type(error).__name__}: {error}") from error
            values = _one_by_one(fn, kwargs, n, error, result)
        result.values[name] = []
        for i, value in enumerate(values):
            if isinstance(value, dict):
                for part, v in value.items():
                    result.parts.setdefault(f"{name}/{part}", [0.0] * n)[i] = float(v)
                value = sum(value.values())
            result.values[name].append(None if value is None else float(value))
            result.totals[i] += weight * (value or 0.0)
    return result


def _one_by_one(fn, kwargs, n, error, result: Scores) -> list:
    """After a batch call raised: score each completion alone, so only the ones that fail get 0."""
    name = reward_name(fn)
    values, failed = [], 0
    for i in range(n):
        single = {k: [v[i]] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        try:
            values.append(call_reward(fn, single, 1)[0])
        except RewardError:
            raise
        except Exception as error:
            if getattr(error, "fatal", False):
                raise
            values.append(0.0)
            failed += 1
    result.errors[name] = result.errors.get(name, 0) + failed
    warnings.warn(f"reward function {name} raised {type(error).__name__}: {error}; {failed} of {n} completions "
                  f"scored 0 (pass strict_rewards to stop instead)", stacklevel=3)
    return values
