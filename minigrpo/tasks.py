"""What a task is (data rows with a `prompt` column, and the reward functions that score completions),
and where one comes from: a built-in name, a task file, a data file, or a hub dataset.

    --task countdown               built-in (`minigrpo tasks`)
    --task my_task.py              a file shaped like the built-ins: TASK = Task(...)
    --task data.jsonl              .jsonl .json .csv .parquet with a `prompt` column; rewards from --reward
    --task openai/gsm8k            a hub dataset, when the `datasets` package and the hub are there
    --task rg:NAME / vf:NAME / openenv:URL   a task from reasoning-gym, verifiers or an OpenEnv server
    --reward my_rewards.py:short   a reward function from a file (or `package.module:function`)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from minigrpo.data import DATA_SUFFIXES, refuse_bad_rows, read_rows, read_rows_and_places
from minigrpo.scoring import reward_name
from minigrpo.sources.spec import split_rows  # noqa: F401 - the built-in tasks' data split, importable from here

# the built-in tasks: a name, and the module of `rewards/` whose TASK it is, loaded by name as a task file is
BUILT_IN = {"addition": "rewards.addition", "countdown": "rewards.countdown", "gsm8k": "rewards.gsm8k",
            "math": "rewards.maths", "code": "rewards.code", "guess": "rewards.guess", "multiply": "rewards.multiply",
            "haiku": "rewards.judge"}


@dataclass
class Task:
    name: str
    description: str  # one line for `minigrpo tasks`
    make_data: Callable[[str, int], list[dict]]  # (split "train" | "test", seed) -> rows with a "prompt"
    rewards: list[Callable]  # the reward contract of minigrpo.scoring
    weights: list[float] | None = None  # one per reward; None: all 1.0
    examples: list[dict] = field(default_factory=list)  # rows plus "completion" (and "expected" total)
    source: Path | None = None  # the data file, for messages that name a line of it
    runs_code: bool = False  # its rewards run model-written code (minigrpo.sandbox.runner): checked at the start
    tools: list[Callable] = field(default_factory=list)  # with tools, each completion is an episode (TRL's `tools=`)
    # a class (or function) making one environment per episode: reset(**row), its methods as tools, and
    # optionally get_reward(); TRL's `environment_factory`
    environment: Callable | None = None
    # a completion's final answer as a string (None: it gave none), for majority votes in evaluation (maj@k)
    answer: Callable | None = None
    environment_prompts: bool = False  # no data: each group's prompt is what its environment's reset() says
    # the total reward of a solved completion (pass@k, retire_solved), where a part of the reward is partial credit
    # or a bonus that could lift an unsolved one to 1.0
    solved_reward: float = 1.0

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(fn) for fn in self.rewards]

    def answer_of(self, completion) -> str | None:
        """The completion's final answer by `answer` (None where it gives none, or where `answer` fails on it: it is
        the task's own code, and neither an evaluation nor a run stops for it)."""
        try:
            return self.answer(completion) if self.answer else None
        except Exception:
            return None


ENVIRONMENT_TASK = "environment"  # --task when --environment supplies the prompts: no data


def get_task(spec: str, extra_rewards: list[str] = (), extra_tools: list[str] = (),
             environment: str | None = None) -> Task:
    """The task `spec` names, with any extra reward functions and tools (\"file.py:function\") appended, and
    `environment` (\"file.py:Class\", TRL's `environment_factory`) as its environment; with the task
    \"environment\", that environment's reset() supplies every prompt, as TRL trains without a dataset."""
    if spec == ENVIRONMENT_TASK:
        if not environment:
            raise ValueError("--task environment takes its prompts from an environment: give --environment file.py:Class")
        task = Task(environment.rpartition(":")[2], f"prompts from {environment}'s reset()", _placeholder_rows,
                    rewards=[], environment_prompts=True)
    elif spec.startswith("rg:"):
        from minigrpo.sources.reasoning_gym import fields_from_spec

        task = Task(**fields_from_spec(spec))
    elif spec.startswith("vf:"):
        from minigrpo.sources.verifiers import fields_from_spec

        task = Task(**fields_from_spec(spec))
    elif spec.startswith("openenv:"):
        from minigrpo.sources.openenv import fields_from_spec

        task = Task(**fields_from_spec(spec))
    elif spec in BUILT_IN:
        task = built_in(spec)
    elif spec.endswith(".py"):
        task = _load_attr(Path(spec), "TASK", f"--task {spec}")
        if not isinstance(task, Task):
            raise ValueError(f"{spec}: TASK must be a minigrpo.tasks.Task, not {type(task).__name__}")
    elif spec.endswith(DATA_SUFFIXES):
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"no data file {spec}")
        task = Task(path.stem, f"rows of {path.name}", _file_data(path), rewards=[], source=path)
    elif "/" in spec and not Path(spec).exists():
        task = Task(spec, f"hub dataset {spec}", _hub_data(spec), rewards=[])
    else:
        raise ValueError(f"unknown task {spec!r}: not a built-in ({', '.join(BUILT_IN)}), a task .py file, "
                         f"a data file ({', '.join(DATA_SUFFIXES)}), or a hub dataset name")
    if environment:
        task = dataclasses.replace(task, environment=load_function(environment, "--environment", "an environment is "
                                                                   "a class with reset(**row) and tool methods"))
    from minigrpo.tools import environment_reward

    owned = environment_reward(task.environment) if task.environment else None
    rewards = list(task.rewards) + [load_reward(r) for r in extra_rewards] + ([owned] if owned else [])
    if not rewards:
        raise ValueError(f"task {task.name} has no reward function; add one with --reward file.py:function")
    weights = (task.weights or [1.0] * len(task.rewards)) + [1.0] * (len(extra_rewards) + bool(owned))
    from minigrpo.tools import environment_tools, schema

    probe = task.environment() if task.environment else None
    if probe is not None and not callable(getattr(probe, "reset", None)):
        raise ValueError(f"task {task.name}: its environment has no reset(**row) method (TRL's contract)")
    tools = list(task.tools) + [load_tool(t) for t in extra_tools]
    for fn in tools + (environment_tools(probe) if probe is not None else []):
        schema(fn)  # a tool the model cannot be told about stops here, named
    names = [fn.__name__ for fn in tools + (environment_tools(probe) if probe is not None else [])]
    if len(set(names)) < len(names):
        raise ValueError(f"two tools share a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))}): "
                         f"the model calls a tool by its name, so each must be distinct")
    return dataclasses.replace(task, rewards=distinct_names(rewards), weights=weights, tools=tools)


def _placeholder_rows(split: str, seed: int) -> list[dict]:
    """The rows of a task whose environment writes the prompts: an empty user turn its reset() fills (as
    TRL's placeholder dataset); none held out, since no fixed prompt exists to keep apart."""
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(64)] if split == "train" else []


def distinct_names(rewards: list[Callable]) -> list[Callable]:
    """Reward functions with the same name (two files' `reward`) would be logged as one: the second is
    renamed `name_2`, and so on, with a warning."""
    seen: dict[str, int] = {}
    out = []
    for fn in rewards:
        name = reward_name(fn)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            new = f"{name}_{seen[name]}"
            warnings.warn(f"two reward functions are named {name}; the one from {_origin(fn)} is logged as {new}",
                          stacklevel=3)
            fn = _renamed(fn, new)
        out.append(fn)
    return out


def _renamed(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def same(*args, **kwargs):
        return fn(*args, **kwargs)

    same.__name__ = name
    return same


def _origin(fn: Callable) -> str:
    code = getattr(getattr(fn, "per_sample", fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def built_in(name: str) -> "Task":
    return importlib.import_module(BUILT_IN[name]).TASK


def load_reward(spec: str) -> Callable:
    """`path/to/file.py:function` or `package.module:function`."""
    return load_function(spec, "--reward", "a reward is fn(prompts, completions, **columns) -> list of floats")


def load_tool(spec: str) -> Callable:
    """`path/to/file.py:function` or `package.module:function`, checked for a schema the model can be given."""
    from minigrpo.tools import schema

    fn = load_function(spec, "--tool", "a tool is a function with type hints and a docstring")
    schema(fn)
    return fn


def load_function(spec: str, flag: str, what: str) -> Callable:
    """The function `spec` names (`file.py:function` or `module:function`), or one line naming what is wrong."""
    where, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise ValueError(f"{flag} {spec!r} must be file.py:function or module:function")
    if where.endswith(".py"):
        fn = _load_attr(Path(where), name, f"{flag} {spec}")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"{flag} {spec!r}: cannot import {where}: {error}") from error
        if not hasattr(module, name):
            raise ValueError(f"{flag} {spec!r}: {where} has no {name}")
        fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{flag} {spec}: {type(fn).__name__} is not a function; {what}")
    return fn


def _load_attr(path: Path, name: str, given: str = ""):
    """`name` from the Python file `path`; a file that fails to load is named, with where (and `given`: the
    flag that named it)."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}" if not path.exists() else f"{path} is not a file")
    spec = importlib.util.spec_from_file_location(f"minigrpo_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(f"{error.filename}, line {error.lineno}: {error.msg} (a syntax error in your file)") from None
    except SystemExit as error:  # its message alone would not say whose it was
        raise ValueError(f"{path} called sys.exit({error.code!r}) while loading{f' ({given})' if given else ''}; "
                         f"a file minigrpo loads must not exit at import (put that code under "
                         f"`if __name__ == '__main__':`)") from None
    except Exception as error:  # the user's own frame, not ours: where in their file the import failed
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__
                  and "importlib" not in f.filename]
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else str(path)
        raise ValueError(f"{where}: {type(error).__name__}: {error} (while loading {path})") from None
    if not hasattr(module, name):
        raise ValueError(f"{path} defines no {name}")
    return getattr(module, name)


def rows_and_places(task: Task, seed: int) -> tuple[list[dict], list[str], str]:
    """All of a task's rows (both splits), where each is, and what to call the source, for messages."""
    if task.source is not None:
        rows, places = read_rows_and_places(task.source)
        return rows, places, str(task.source)
    train, test = task.make_data("train", seed), task.make_data("test", seed)
    places = [f"train row {i}" for i in range(1, len(train) + 1)] + [f"test row {i}" for i in range(1, len(test) + 1)]
    return train + test, places, f"task {task.name}"


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
        refuse_bad_rows(rows, name)
        return rows

    return load


def refuse_unconfined_code(task: Task, allow_unconfined: bool, say) -> None:
    """Where the task's rewards run model-written code: say which layers confine it, and refuse a machine
    that lacks a required one unless the user allowed it."""
    if not task.runs_code:
        return
    from minigrpo.sandbox import runner as sandbox

    if allow_unconfined:
        os.environ[sandbox.ALLOW_ENV] = "1"  # read by the sandbox in every call the rewards make
    sandbox.announce(say)
