"""Rollouts: prompts drawn from the pool, G completions each, decoded and scored; with filter_groups, only
the groups whose rewards differ (DAPO's dynamic sampling); and the prompt pool with its curriculum."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.generate import Generator, Sampling
from minigrpo.scoring import (NESTED, PER_COMPLETION, PER_PROMPT, SUMMED, Scores, along, join_batches, pick_groups,
                              score, trainer_state)
from minigrpo.tasks import Task
from minigrpo.tools import environment_tools, render_prompt

if TYPE_CHECKING:  # a type only: state.py is above this module
    from minigrpo.state import RunState


@dataclass
class Completed:
    """What `complete` sampled: one entry per completion, in group order."""
    prompt_ids: list[list[int]]  # [P]
    completion_ids: list[list[int]]
    completions: list  # text, or chat messages (chat-format prompts, and every episode)
    truncated: list[bool]
    sampler_logps: list[list[float]] | None
    model_masks: list[list[bool]] | None  # episodes: True where the model wrote the token
    stats: dict  # episodes: totals of turns, tool calls, tool errors, cuts (`episodes.episode_stats`)
    columns: list[dict]  # [B] what the rewards get beside the completion: the row, and its episode's environment


def complete(cfg: TrainConfig, tokenizer, generator: Generator, task: Task, rows: list[dict],
             sampling: Sampling) -> Completed:
    """`sampling.n` completions of each row's prompt: single replies, or, where the task has tools or an
    environment, episodes (one environment per episode, reset from its row; its reset's text ends the prompt)."""
    from minigrpo import episodes as E

    n = sampling.n
    envs, said = E.start_environments(task.environment, rows, n, task.environment_prompts) if task.environment \
        else (None, [None] * len(rows))
    tools = list(task.tools) + (environment_tools(envs[0]) if envs else [])
    prompts = [joined(row["prompt"], text) for row, text in zip(rows, said)]
    prompt_ids = [tokenizer(render_prompt(tokenizer, p, tools), add_special_tokens=False).input_ids for p in prompts]
    for p, ids in zip(prompts, prompt_ids):
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(f"a prompt of {len(ids)} tokens is longer than max_prompt_tokens="
                             f"{cfg.max_prompt_tokens}: {str(p)[:80]!r}...")
    # the rewards get the prompt as the model read it (with the reset's text, as TRL passes it)
    columns = [dict(rows[i // n], prompt=prompts[i // n], **({"environments": envs[i]} if envs else {}))
               for i in range(len(rows) * n)]
    if not tools and not envs:
        out = generator.generate(prompt_ids, sampling)
        completions = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        if isinstance(rows[0]["prompt"], list):  # chat-format data gets chat-format completions, as in TRL
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        return Completed(prompt_ids, out.completion_ids, completions, out.truncated, out.sampler_logps, None, {},
                         columns)
    limits = E.Limits(sampling.max_new_tokens, cfg.max_turns, cfg.completion_tokens, cfg.tool_timeout,
                      temperature=sampling.temperature, top_p=sampling.top_p)
    episodes = E.run_episodes(generator, tokenizer, task.tools, prompt_ids, n, limits, envs)
    logps = [e.logps for e in episodes] if all(e.logps is not None for e in episodes) else None
    return Completed(prompt_ids, [e.ids for e in episodes], [e.messages for e in episodes],
                     [e.truncated for e in episodes], logps, [e.mask for e in episodes], E.episode_stats(episodes),
                     columns)


def joined(prompt: str | list[dict], text: str | None) -> str | list[dict]:
    """The prompt with an environment's reset text at the end of its last message, as TRL joins them."""
    if text is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + text
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + text}]


@dataclass
class Groups:
    """Completions for some prompts, G per prompt, in group order, with their scores."""
    rows: list[dict] = along(PER_PROMPT)  # [P] data rows
    prompt_ids: list[list[int]] = along(PER_PROMPT)  # [P]
    completion_ids: list[list[int]] = along(PER_COMPLETION)  # [B = P x G]
    completions: list = along(PER_COMPLETION)  # [B] decoded text
    truncated: list[bool] = along(PER_COMPLETION)  # [B]
    sampler_logps: list[list[float]] | None = along(PER_COMPLETION)  # [B], from engines that report them
    scores: Scores = along(NESTED)
    generate_s: float = along(SUMMED, default=0.0)  # seconds spent sampling these
    reward_s: float = along(SUMMED, default=0.0)  # seconds spent scoring them
    # [B] per completion token, True where the model wrote it; None: every token is the model's. In an
    # episode, tool results and environment text sit in the completion as context and are never trained on
    model_masks: list[list[bool]] | None = along(PER_COMPLETION, default=None)
    episode_stats: dict = along(SUMMED, default_factory=dict)  # totals over every episode sampled, kept or not
    # [P] as the model read them (an environment's reset text joined); None: the rows'
    prompts: list | None = along(PER_PROMPT, default=None)

    def select(self, groups: list[int], G: int) -> "Groups":
        return pick_groups(self, groups, G)

    def __add__(self, other: "Groups") -> "Groups":
        return join_batches(self, other)


def rollout(cfg: TrainConfig, tokenizer, generator: Generator, task: Task, rows: list[dict], state=None) -> Groups:
    """G completions for each row's prompt, decoded and scored (`state`: the rewards' trainer_state)."""
    G = cfg.num_generations
    t0 = time.perf_counter()
    out = complete(cfg, tokenizer, generator, task, rows, Sampling(G, cfg.max_new_tokens, cfg.temperature, cfg.top_p))
    t1 = time.perf_counter()
    scores = score(task.rewards, task.weights, [c["prompt"] for c in out.columns], out.completions, out.completion_ids,
                   out.columns, strict=cfg.strict_rewards, timeout=cfg.reward_timeout, state=state)
    return Groups(rows, out.prompt_ids, out.completion_ids, out.completions, out.truncated, out.sampler_logps,
                  scores, t1 - t0, time.perf_counter() - t1, out.model_masks, out.stats,
                  [out.columns[i * G]["prompt"] for i in range(len(rows))])


def collect(cfg: TrainConfig, run: "RunState", task: Task, step: int = 1) -> tuple[Groups, dict]:
    """The step's groups, drawn from the run's prompt pool and sampled by its generator. With filter_groups, groups
    whose rewards are all equal (no gradient) are dropped and more prompts are drawn, for at most
    max_filter_rounds extra rounds (DAPO's dynamic sampling)."""
    G, tokenizer, generator, prompts = cfg.num_generations, run.tokenizer, run.generator, run.prompts
    done = step - 1  # optimizer steps taken, as TRL's state counts them while the step's rewards run
    state = trainer_state(done, cfg.steps, done * cfg.prompts_per_step / len(prompts.rows))
    batch = rollout(cfg, tokenizer, generator, task, prompts.draw(cfg.prompts_per_step), state)
    prompts.record(batch.rows, batch.scores.totals, G, task.solved_reward)
    spread = L.groups_with_spread(torch.tensor(batch.scores.totals), G, cfg.advantage).tolist()
    info = {"frac_groups_reward_differs": float(np.mean(spread)), "filter/extra_rounds": 0,
            "tokens_generated": generated_tokens(batch),
            "generate_s": batch.generate_s, "reward_s": batch.reward_s}
    if cfg.advantage == "maxrl":  # it reads rewards as successes in [0, 1]: a reward below 0 is out of its reach
        info["maxrl/groups_below_zero"] = int((torch.tensor(batch.scores.totals).view(-1, G) < 0).any(1).sum())
    if not cfg.filter_groups:
        return batch, info | episode_metrics(batch.episode_stats)
    kept = batch.select([i for i, s in enumerate(spread) if s], G)
    while len(kept.rows) < cfg.prompts_per_step and info["filter/extra_rounds"] < cfg.max_filter_rounds:
        info["filter/extra_rounds"] += 1
        more = rollout(cfg, tokenizer, generator, task, prompts.draw(cfg.prompts_per_step), state)
        prompts.record(more.rows, more.scores.totals, G, task.solved_reward)
        info["tokens_generated"] += generated_tokens(more)
        info["generate_s"] += more.generate_s
        info["reward_s"] += more.reward_s
        spread = L.groups_with_spread(torch.tensor(more.scores.totals), G, cfg.advantage).tolist()
        kept = kept + more.select([i for i, s in enumerate(spread) if s], G)
    kept = kept.select(list(range(min(len(kept.rows), cfg.prompts_per_step))), G)
    info["filter/groups_trained"] = len(kept.rows)
    return kept, info | episode_metrics(kept.episode_stats)


def generated_tokens(batch: Groups) -> int:
    """The tokens the model wrote (an episode's tool results are not generated)."""
    if batch.model_masks is not None:
        return sum(map(sum, batch.model_masks))
    return sum(map(len, batch.completion_ids))


def episode_metrics(stats: dict) -> dict:
    """Per-episode means of turns and tool calls, and counts of tool errors and of episodes cut by a limit."""
    if not stats.get("episodes"):
        return {}
    n = stats["episodes"]
    return {"episode/turns": stats["turns"] / n, "episode/tool_calls": stats["tool_calls"] / n,
            "episode/tool_errors": stats["tool_errors"], "episode/cut_by_turns": stats["cut_by_turns"],
            "episode/cut_by_tokens": stats["cut_by_tokens"]}
