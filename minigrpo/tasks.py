"""What a task is (data rows with a `prompt` column, and the reward functions that score completions),
and where one comes from: a built-in name, a task file, a data file, or a hub dataset.

    --task countdown               built-in (`minigrpo tasks`)
    --task my_task.py              a file shaped like the built-ins: TASK = Task(...)
    --task data.jsonl              .jsonl .json .csv .parquet with a `prompt` column; rewards from --reward
    --task openai/gsm8k            a hub dataset, when the `datasets` package and the hub are there
    --reward my_rewards.py:short   a reward function from a file (or `package.module:function`)
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from minigrpo.scoring import reward_name

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass
class Task:
    name: str
    description: str  # one line for `minigrpo tasks`
    make_data: Callable[[str, int], list[dict]]  # (split "train" | "test", seed) -> rows with a "prompt"
    rewards: list[Callable]  # the reward contract of minigrpo.scoring
    weights: list[float] | None = None  # one per reward; None: all 1.0
    examples: list[dict] = field(default_factory=list)  # rows plus "completion" (and "expected" total)

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(fn) for fn in self.rewards]


def get_task(spec: str, extra_rewards: list[str] = (), seed: int = 0) -> Task:
    """The task `spec` names, with any extra reward functions appended."""
    from rewards import TASKS

    if spec in TASKS:
        task = TASKS[spec]
    elif spec.endswith(".py"):
        task = _load_attr(Path(spec), "TASK")
    elif spec.endswith(DATA_SUFFIXES):
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"no data file {spec}")
        task = Task(path.stem, f"rows of {path.name}", _file_data(path), rewards=[])
    elif "/" in spec and not Path(spec).exists():
        task = Task(spec, f"hub dataset {spec}", _hub_data(spec), rewards=[])
    else:
        raise ValueError(f"unknown task {spec!r}: not a built-in ({', '.join(TASKS)}), a task .py file, "
                         f"a data file ({', '.join(DATA_SUFFIXES)}), or a hub dataset name")
    rewards = list(task.rewards) + [load_reward(r) for r in extra_rewards]
    if not rewards:
        raise ValueError(f"task {task.name} has no reward function; add one with --reward file.py:function")
    weights = (task.weights or [1.0] * len(task.rewards)) + [1.0] * len(extra_rewards)
    return Task(task.name, task.description, task.make_data, rewards, weights, task.examples)


def load_reward(spec: str) -> Callable:
    """`path/to/file.py:function` or `package.module:function`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise ValueError(f"--reward {spec!r} must be file.py:function or module:function")
    if where.endswith(".py"):
        return _load_attr(Path(where), name)
    try:
        module = importlib.import_module(where)
    except ImportError as error:
        raise ValueError(f"--reward {spec!r}: cannot import {where}: {error}") from error
    if not hasattr(module, name):
        raise ValueError(f"--reward {spec!r}: {where} has no {name}")
    return getattr(module, name)


def _load_attr(path: Path, name: str):
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"minigrpo_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise ValueError(f"{path} defines no {name}")
    return getattr(module, name)


def read_rows(path: Path) -> list[dict]:
    """Rows of a data file; a malformed line or a row without `prompt` is an error that names it."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg}): {line[:80]!r}") from None
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from None
    elif path.suffix == ".csv":
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: unknown data format; use one of {', '.join(DATA_SUFFIXES)}")
    check_rows(rows, str(path))
    return rows


def check_rows(rows, source: str) -> None:
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{source}: no rows (expected a list of objects with a 'prompt' field)")
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or "prompt" not in row:
            where = f"line {i}" if source.endswith(".jsonl") else f"row {i}"
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{source}, {where}: no 'prompt' column (it has {keys})")


def split_rows(rows: list[dict], split: str, seed: int) -> list[dict]:
    """A fixed, seeded held-out slice for "test" (a tenth, at most 200 rows); the rest for "train"."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = min(200, len(rows) // 10)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [rows[i] for i in sorted(chosen)]


def _file_data(path: Path) -> Callable[[str, int], list[dict]]:
    return lambda split, seed: split_rows(read_rows(path), split, seed)


def _hub_data(name: str) -> Callable[[str, int], list[dict]]:
    def load(split: str, seed: int) -> list[dict]:
        try:
            import datasets
        except ImportError:
            raise ValueError(f"loading the hub dataset {name} needs the `datasets` package") from None
        ds = datasets.load_dataset(name, split="train" if split == "train" else "test")
        rows = ds.to_list()
        check_rows(rows, name)
        return rows

    return load


def check_sandbox(allow_unconfined: bool, say) -> None:
    """Where the task's rewards run model-written code (they imported the sandbox): say which layers
    confine it, and refuse a machine that lacks a required one unless the user allowed it."""
    if "minigrpo.sandbox" not in sys.modules:
        return
    from minigrpo import sandbox

    if allow_unconfined:
        os.environ[sandbox.ALLOW_ENV] = "1"  # read by the sandbox in every call the rewards make
    sandbox.announce(say)
