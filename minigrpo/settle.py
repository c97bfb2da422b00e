"""Where a config gets its final values: the one module that changes a TrainConfig after it is made.

A command line (or a notebook) makes a config, and some of its values wait on facts known only later: the task
(whether a completion is an episode of turns), its held-out rows (whether a before/after evaluation can run), the
clock (a new run folder's name), the memory plan (gradient checkpointing), an SFT warm-up's examples (its token
budgets). Each function here takes those facts and returns a finished copy, leaving the one it was given as it
was; the rest of the code reads configs and never writes them (tests/test_settle.py holds it to that).

    >>> cfg = TrainConfig(steps=10)
    >>> overridden(cfg, steps=20, seed=None).steps, cfg.steps   # None: left as it was
    (20, 10)
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from minigrpo.config import TrainConfig
from minigrpo.data import DATA_SUFFIXES, read_rows
from minigrpo.sources.spec import repeated_prompts
from minigrpo.tasks import Task


HOW_TO_HOLD_OUT = "give --eval-data FILE (rows kept out of training), or a data file of 10 rows or more (a tenth is held out)"


def held_out_rows(cfg: TrainConfig, task: Task) -> list[dict]:
    """The rows an evaluation uses: --eval-data's, or the task's own held-out split; at most eval_prompts."""
    rows = read_rows(Path(cfg.eval_data)) if cfg.eval_data else task.make_data("test", cfg.seed)
    return rows[:cfg.eval_prompts]


def run_task(task: Task, cfg: TrainConfig) -> Task:
    """The task as a run holds it: the run's reward weights (--reward-weight's, else its own, else 1.0 each, one
    per reward) and the total reward at which a completion counts as solved (--solved-reward, else its own)."""
    weights = list(cfg.reward_weights or task.weights or [1.0] * len(task.rewards))
    if len(weights) != len(task.rewards):
        raise ValueError(f"{len(weights)} reward weights for the {len(task.rewards)} reward functions "
                         f"{task.reward_names}")
    return dataclasses.replace(task, weights=weights, solved_reward=solved_reward(cfg, task))


def overridden(cfg: TrainConfig, **values) -> TrainConfig:
    """`cfg` with the values given that are not None: the flags of a command that continues or reads a run."""
    return dataclasses.replace(cfg, **{k: v for k, v in values.items() if v is not None})


def solved_reward(cfg: TrainConfig, task: Task) -> float:
    """The total reward at which a completion counts as solved: the config's solved_reward if set, else the task's."""
    return task.solved_reward if cfg.solved_reward is None else cfg.solved_reward


def episode_budget(cfg: TrainConfig, task: Task) -> TrainConfig:
    """Where the task's completions are episodes, an unset --max-episode-tokens becomes max-turns x
    max-new-tokens (recorded in the run's config.json)."""
    if (task.tools or task.environment) and cfg.max_episode_tokens is None:
        return dataclasses.replace(cfg, max_episode_tokens=cfg.max_turns * cfg.max_new_tokens)
    return cfg


def refuse_missing_eval_data(path: str | None) -> None:
    if path and not Path(path).is_file():
        raise ValueError(f"--eval-data {path}: no such file; give a data file of held-out rows")


def evaluation(cfg: TrainConfig, task: Task, train_rows: list[dict]) -> tuple[TrainConfig, str | None]:
    """Before the model loads: a task with no held-out rows (a small data file) trains anyway, its default
    before/after evaluation skipped with a note (returned); an evaluation asked for (--eval-every) stops.
    --eval-data must be a file, and a note says when its prompts are among the training ones (the task's own
    split is the task's to keep apart)."""
    refuse_missing_eval_data(cfg.eval_data)
    if not (cfg.eval_every or cfg.eval_before_after):
        return cfg, None
    rows = held_out_rows(cfg, task)
    if not rows and cfg.eval_every:
        raise ValueError(f"--eval-every {cfg.eval_every}: task {task.name} has no held-out rows; {HOW_TO_HOLD_OUT}")
    if not rows:
        return dataclasses.replace(cfg, eval_before_after=False), (
            f"task {task.name} has no held-out rows, so the before/after evaluation is skipped; for it, "
            f"{HOW_TO_HOLD_OUT}")
    if not cfg.eval_data:
        repeats = repeated_prompts(read_rows(task.source)) if task.source is not None else 0
        return cfg, (f"{task.source}: {repeats} rows repeat an earlier row's prompt; each prompt is kept to one "
                     f"split, so none of the held-out ones is trained on") if repeats else None
    trained = {json.dumps(r["prompt"], sort_keys=True) for r in train_rows}
    seen = sum(json.dumps(r["prompt"], sort_keys=True) in trained for r in rows)
    return cfg, f"{seen} of the {len(rows)} held-out prompts are also training prompts" if seen else None


def run_folder(cfg: TrainConfig) -> TrainConfig:
    """A new run with no --out gets runs/<time>-<model>-<task>."""
    if cfg.output_dir is not None:
        return cfg
    name = Path(cfg.model.rstrip("/")).name
    task = Path(cfg.task).stem if cfg.task.endswith((".py", *DATA_SUFFIXES)) else \
        re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.task).strip("-")  # rg:..., openenv:http://...
    return dataclasses.replace(cfg, output_dir=str(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{task}"))


def checkpointing(cfg: TrainConfig, planned: bool) -> TrainConfig:
    """An unset --gradient-checkpointing takes the memory plan's choice (config.json records it)."""
    return cfg if cfg.gradient_checkpointing is not None else dataclasses.replace(cfg, gradient_checkpointing=planned)


def for_sft(cfg: TrainConfig, longest_prompt: int, longest_completion: int) -> TrainConfig:
    """An SFT warm-up's budgets are its examples' lengths, and it starts no engine (nothing is generated)."""
    return dataclasses.replace(cfg, max_prompt_tokens=longest_prompt, max_new_tokens=longest_completion,
                               generator="hf")
