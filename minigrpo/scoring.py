"""Calling reward functions: one contract, checked on every call, with errors that name the culprit.

The contract is TRL's, so reward code moves between the two unchanged:

    fn(prompts, completions, completion_ids, **columns) -> list[float | dict[str, float] | None]

called with keywords, one value per completion. `columns` are the data's other fields, one value per
completion. `None` means "does not apply here" and is left out of that function's mean (it adds 0 to the
total). A dict holds named parts: they are summed, and each is logged as `reward/<fn>/<part>/mean`.
Beyond TRL, an exception object in place of a value says that completion could not be scored (a judge's
malformed reply): it scores 0 and is counted in `reward/<fn>/errors`, as raising on it alone would be.
Chat-format prompts (lists of messages) get chat-format completions: `[{"role": "assistant", ...}]`.
`async def` reward functions are awaited.

For hobby rewards that score one completion at a time, `@per_sample` turns

    @per_sample
    def short(completion: str, **example) -> float:
        return 1.0 if len(completion) < 200 else 0.0

into that contract (a dict return gives parts too).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable

from minigrpo.guard import OutOfTime, awaited, real_interrupts, time_limit

RESERVED = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}  # not data


class RewardError(RuntimeError):
    """A reward function broke the contract: which function, and why."""


def per_sample(fn: Callable) -> Callable:
    """Lift `fn(completion: str, **example) -> float | dict | None` to the batch contract."""

    @functools.wraps(fn)
    def batch(prompts, completions, completion_ids=None, **columns):
        out = []
        for i, completion in enumerate(completions):
            # a data column has one value per completion; what else arrives (trainer_state, log_metric) is whole
            example = {key: values[i] if isinstance(values, list) and len(values) == len(completions) else values
                       for key, values in columns.items()}
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


# how a batch's field follows its completions when groups are picked out of it or two batches are joined:
# one value per prompt, one per completion, columns of one per completion, totals summed, lists pooled
PER_PROMPT, PER_COMPLETION, COLUMNS, SUMMED, POOLED, NESTED = "prompt", "completion", "columns", "sum", "pool", "nested"


def along(kind: str, **default) -> field:
    return field(metadata={"along": kind}, **default)


@dataclass
class Scores:
    totals: list[float] = along(PER_COMPLETION)  # [B] weighted sum over functions (None counts 0)
    values: dict[str, list[float | None]] = along(COLUMNS)  # function -> [B], None where it does not apply
    parts: dict[str, list[float]] = along(COLUMNS, default_factory=dict)  # "fn/part" -> [B] for dict-valued rewards
    errors: dict[str, int] = along(SUMMED, default_factory=dict)  # function -> samples that raised and scored 0
    extra: dict[str, list] = along(COLUMNS, default_factory=dict)  # column -> [B]: what rewards passed to log_extra
    metrics: dict[str, list[float]] = along(POOLED, default_factory=dict)  # name -> values passed to log_metric


def pick_groups(batch, groups: list[int], G: int):
    """The same kind of batch holding only `groups` (indices of prompts), each with its G completions."""
    rows = [i * G + j for i in groups for j in range(G)]
    n = len(batch.totals) if isinstance(batch, Scores) else len(batch.completions)

    def pick(value, kind: str):
        if value is None or kind in (SUMMED, POOLED):
            return value  # whole-step figures stay with whatever part of the step is kept
        if kind == NESTED:
            return pick_groups(value, groups, G)
        if kind == COLUMNS:  # a log_extra column of another length than the batch's cannot be split: dropped
            return {k: [v[i] for i in rows] for k, v in value.items() if len(v) == n}
        return [value[i] for i in (groups if kind == PER_PROMPT else rows)]

    return type(batch)(**{f.name: pick(getattr(batch, f.name), f.metadata["along"]) for f in fields(batch)})


def join_batches(a, b):
    """Two batches of the same kind as one: a's groups, then b's."""
    n_a, n_b = (len(x.totals) if isinstance(x, Scores) else len(x.completions) for x in (a, b))

    def join(x, y, kind: str):
        if kind == NESTED:
            return join_batches(x, y)
        if kind in (PER_PROMPT, PER_COMPLETION):
            return x + y if x is not None and y is not None else None
        if kind == COLUMNS:  # a column one side lacks is None (does not apply) on that side
            return {k: x.get(k, [None] * n_a) + y.get(k, [None] * n_b) for k in x.keys() | y.keys()}
        if kind == POOLED:
            return {k: x.get(k, []) + y.get(k, []) for k in x.keys() | y.keys()}
        return {k: x.get(k, 0) + y.get(k, 0) for k in x.keys() | y.keys()} if isinstance(x, dict) else x + y

    return type(a)(**{f.name: join(getattr(a, f.name), getattr(b, f.name), f.metadata["along"]) for f in fields(a)})


class RewardCrash(Exception):
    """A reward call that did not return: it raised, exited, or ran past its time. Scored like raising."""


def call_reward(fn: Callable, kwargs: dict, n: int, timeout: float | None = None) -> list:
    """One call under the contract, on copies of its arguments (a reward that edits them in place changes
    nothing outside), within `timeout` seconds per completion. Raises RewardCrash when the call did not
    return (SystemExit and a KeyboardInterrupt raised by the reward's code included), RewardError for the
    wrong length or a value that is no finite real number. Real numbers of any type (numpy's, bools) are
    taken as floats, as TRL does."""
    name = reward_name(fn)
    try:
        with time_limit(timeout * max(n, 1) if timeout else None, f"reward function {name}",
                        "--reward-timeout sets it per completion"), real_interrupts() as interrupted:
            values = awaited(fn(**copy.deepcopy(kwargs)))
    except OutOfTime as error:
        raise RewardCrash(str(error)) from None
    except SystemExit as error:
        raise RewardCrash(f"called sys.exit({error.code!r})") from None
    except KeyboardInterrupt:
        if interrupted:
            raise  # a real Ctrl-C
        raise RewardCrash("raised KeyboardInterrupt") from None
    except Exception as error:
        if getattr(error, "fatal", False):  # the machine cannot run this reward (e.g. SandboxError)
            raise
        raise RewardCrash(f"raised {type(error).__name__}: {error}") from error
    if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward function {name} returned {type(values).__name__}; "
                          f"it must return a list with one value per completion")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions; "
                          f"it must return one per completion")
    return [_checked(name, i, value) for i, value in enumerate(values)]


def _checked(name: str, i: int, value):
    """A value as a float (a dict of them, None, or an exception the reward returned for a completion it
    could not score), or a RewardError that says what it was."""
    if value is None or isinstance(value, Exception):
        return value
    parts = value if isinstance(value, dict) else {None: value}
    out = {}
    for key, v in parts.items():
        number = None if isinstance(v, (str, bytes)) or not hasattr(v, "__float__") else float(v)
        if number is None or not math.isfinite(number):
            raise RewardError(f"reward function {name} returned {value!r} for completion {i}; "
                              f"each value must be a finite number, a dict of them, or None")
        out[key] = number
    return out if isinstance(value, dict) else out[None]


def score(reward_fns: list[Callable], weights: list[float] | None, prompts: list, completions: list,
          completion_ids: list[list[int]], rows: list[dict], strict: bool = False,
          timeout: float | None = None, state=None) -> Scores:
    """Every reward function on one batch. A function that raises (or exits, or runs past `timeout`
    seconds per completion) scores 0 on the samples it fails on, with a warning and a counter, unless
    `strict`; a broken contract is always a RewardError. `weights` None: 1.0 each, as a Task's."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    n = len(completions)
    result = Scores(totals=[0.0] * n, values={})
    # what TRL passes every reward beside the data: the trainer's state and two ways to log
    extras = {"trainer_state": state if state is not None else trainer_state(),
              "log_extra": lambda column, values: result.extra.setdefault(column, []).extend(values),
              "log_metric": lambda name, value: result.metrics.setdefault(name, []).append(float(value))}
    for fn, weight in zip(reward_fns, weights or [1.0] * len(reward_fns)):
        name = reward_name(fn)
        missing = [c for c in required_columns(fn) if c not in columns]
        if "completion" in missing:
            raise RewardError(f"reward function {name} takes one `completion`, but the contract passes lists "
                              f"(`completions`): decorate it with @per_sample (from minigrpo import per_sample)")
        if missing:
            raise RewardError(f"reward function {name} needs the column(s) {missing}, which the data does not "
                              f"have; it has: {sorted(columns) or 'only prompt'}")
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extras)
        logged = {column: len(values) for column, values in result.extra.items()}
        try:
            values = call_reward(fn, kwargs, n, timeout)
        except RewardCrash as error:
            if strict:
                raise RewardError(f"reward function {name} {error}") from None
            for column in result.extra:  # logged by the failed call: the calls one by one log it again
                del result.extra[column][logged.get(column, 0):]
            values = _one_by_one(fn, kwargs, n, error, result, timeout)
        values = _unscored(name, values, result, strict)
        result.values[name] = []
        for i, value in enumerate(values):
            if isinstance(value, dict):
                for part, v in value.items():
                    result.parts.setdefault(f"{name}/{part}", [0.0] * n)[i] = v
                value = sum(value.values())
            result.values[name].append(value)
            result.totals[i] += weight * (value or 0.0)
    return result


def trainer_state(step: int = 0, max_steps: int = 0, epoch: float = 0.0):
    """What TRL passes rewards as `trainer_state`: transformers' TrainerState, at the optimizer steps done
    so far (a reward that shapes itself by progress reads `global_step` and `max_steps`)."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, epoch=epoch)


def _unscored(name: str, values: list, result: Scores, strict: bool) -> list:
    """An exception in place of a value is a completion the reward could not score (a judge's malformed
    reply): 0, counted and warned about as if the reward had raised on it alone."""
    failed = [v for v in values if isinstance(v, Exception)]
    if not failed:
        return values
    if strict:
        raise RewardError(f"reward function {name} could not score a completion: {failed[0]}")
    result.errors[name] = result.errors.get(name, 0) + len(failed)
    warnings.warn(f"reward function {name} could not score {len(failed)} of {len(values)} completions "
                  f"({failed[0]}); they scored 0", stacklevel=3)
    return [0.0 if isinstance(v, Exception) else v for v in values]


def _one_by_one(fn, kwargs, n, error, result: Scores, timeout: float | None) -> list:
    """After a batch call failed: score each completion alone, so only the ones that fail get 0."""
    name = reward_name(fn)
    values, failed = [], 0
    for i in range(n):
        single = {k: [v[i]] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        try:
            values.append(call_reward(fn, single, 1, timeout)[0])
        except RewardCrash:
            values.append(0.0)
            failed += 1
    result.errors[name] = result.errors.get(name, 0) + failed
    warnings.warn(f"reward function {name} {error}; {failed} of {n} completions scored 0 "
                  f"(pass strict_rewards to stop instead)", stacklevel=3)
    return values
