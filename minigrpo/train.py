"""The GRPO loop. One step, top to bottom:

    prompts -> G completions each -> rewards -> group-relative advantages
            -> (reference log-probs) -> clipped loss, backward, optimizer step -> sync the generator -> log

What it keeps of GRPO (DeepSeekMath): groups of G samples per prompt, advantages relative to the group,
the PPO-clipped ratio against the sampling-time policy, and an optional k3 KL to the reference (the base
with its adapters disabled). What it drops: a value model, and a separate reference copy.
"""

from __future__ import annotations

import random
import resource
import time
from pathlib import Path

import numpy as np
import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.console import Display
from minigrpo.generation import Generator, Sampling, make_generator
from minigrpo.model import load_policy, load_tokenizer, lora_parameters, resolve_weights, token_logprobs
from minigrpo.run import RunFolder
from minigrpo.tasks import Task, get_task, score


def train(cfg: TrainConfig) -> Path:
    """Train a LoRA adapter with GRPO as `cfg` says; returns the run folder."""
    seed_everything(cfg.seed)
    task = get_task(cfg.task)
    weights = cfg.reward_weights or task.weights or [1.0] * len(task.rewards)
    if len(weights) != len(task.rewards):
        raise ValueError(f"{len(weights)} reward weights for {len(task.rewards)} reward functions of {task.name}")
    run = RunFolder.create(cfg)
    display = Display(cfg.steps)
    display.print(f"[bold]minigrpo[/] {cfg.model} on {task.name}: {cfg.prompts_per_step} prompts x "
                  f"{cfg.num_generations} completions per step, {cfg.steps} steps -> {run.path}")

    weights_path = resolve_weights(cfg.hub_id)
    tokenizer = load_tokenizer(weights_path)
    model = load_policy(cfg, weights_path)
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    generator = make_generator(cfg, model, tokenizer)
    prompts = PromptSampler(task.make_data("train", cfg.seed), cfg.seed)

    step = 0
    try:
        with display:
            for step in range(1, cfg.steps + 1):
                rows = prompts.draw(cfg.prompts_per_step)
                metrics, samples = train_step(cfg, step, model, tokenizer, generator, optimizer, scheduler,
                                              task, weights, rows)
                run.log(metrics, samples)
                display.step(metrics)
                if cfg.sample_every and (step == 1 or step % cfg.sample_every == 0):
                    display.sample(step, random.Random(step).choice(samples))
    except KeyboardInterrupt:
        display.print(f"[yellow]interrupted during step {step}; saving the adapter[/]")
    adapter = run.save_adapter(model)
    display.print(f"adapter saved to {adapter}")
    return run.path


def train_step(cfg: TrainConfig, step: int, model, tokenizer, generator: Generator, optimizer, scheduler,
               task: Task, weights: list[float], rows: list[dict]) -> tuple[dict, list[dict]]:
    """One GRPO step on `rows` (one dict per prompt); returns the step's metrics and its samples."""
    G = cfg.num_generations
    t0 = time.perf_counter()

    # 1. sample G completions per prompt
    prompt_texts = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    prompt_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in prompt_texts]
    for row, ids in zip(rows, prompt_ids):
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(f"a prompt of {len(ids)} tokens is longer than max_prompt_tokens="
                             f"{cfg.max_prompt_tokens}: {str(row['prompt'])[:80]!r}...")
    rollout = generator.generate(prompt_ids, Sampling(G, cfg.max_new_tokens, cfg.temperature, cfg.top_p))
    completions = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    t_generate = time.perf_counter()

    # 2. score them, and turn rewards into advantages within each group
    group_rows = [row for row in rows for _ in range(G)]
    group_prompts = [text for text in prompt_texts for _ in range(G)]
    rewards, parts = score(task, weights, group_prompts, completions, rollout.completion_ids, group_rows)
    rewards = torch.tensor(rewards)  # [B]
    advantages = L.advantages(rewards, G, cfg.scale_rewards)  # [B]
    t_reward = time.perf_counter()

    # 3. loss and backward, micro-batch by micro-batch, so memory does not grow with B
    model.train()
    rows_ids = [(prompt_ids[i // G], c) for i, c in enumerate(rollout.completion_ids)]
    lengths = torch.tensor([len(c) for c in rollout.completion_ids])  # [B]
    full_mask = torch.arange(lengths.max())[None, :] < lengths[:, None]  # [B, T]
    sampler = None
    if rollout.sampler_logps is not None:  # the engine's log-probs, to measure and correct its gap
        sampler = torch.zeros(full_mask.shape)  # [B, T]
        for i, row in enumerate(rollout.sampler_logps):
            sampler[i, :len(row)] = torch.tensor(row)
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio/mean": 0.0}
    gap_sum, gap_max = 0.0, 0.0
    for start in range(0, len(rows_ids), cfg.micro_batch_size):
        chunk = slice(start, start + cfg.micro_batch_size)
        ids, attention, mask = pad_batch(rows_ids[chunk], tokenizer.pad_token_id, model.device)
        n = mask.shape[1]
        ref_logps = None
        if cfg.beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_logps = token_logprobs(model, ids, attention, n, cfg.temperature, cfg.logprob_chunk_size)
        logps = token_logprobs(model, ids, attention, n, cfg.temperature, cfg.logprob_chunk_size)  # [b, n]
        # one optimizer pass per rollout: the sampling-time policy is the current one, so old = current
        sampler_logps = sampler[chunk, :n].to(logps.device) if sampler is not None else None  # [b, n]
        loss, m = L.policy_loss(logps, logps.detach(), ref_logps, advantages[chunk].to(logps.device), mask,
                                epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                aggregation=cfg.loss_aggregation, max_tokens=cfg.max_new_tokens,
                                sampler_logps=sampler_logps, tis_cap=cfg.tis_cap)
        if sampler_logps is not None:
            gap = (logps.detach() - sampler_logps).abs()[mask]  # [tokens]
            gap_sum, gap_max = gap_sum + gap.sum().item(), max(gap_max, gap.max().item())
        weight = L.microbatch_weight(mask, full_mask, cfg.loss_aggregation)
        (loss * weight).backward()
        tokens_share = mask.sum().item() / full_mask.sum().item()
        totals["loss"] += loss.item() * weight
        for key in ("kl", "clip_frac", "ratio/mean"):
            totals[key] += m[key] * tokens_share

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    t_sync = time.perf_counter()
    generator.sync(model)
    t_end = time.perf_counter()

    # 4. log
    spread = L.groups_with_spread(rewards, G)
    metrics = {
        "step": step,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        **{f"reward/{name}/mean": float(np.mean(values)) for name, values in parts.items()},
        "frac_groups_reward_differs": spread.float().mean().item(),
        **totals,
        "completion_len/mean": lengths.float().mean().item(),
        "completion_len/max": lengths.max().item(),
        "truncated_frac": float(np.mean(rollout.truncated)),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "time/generate": t_generate - t0,
        "time/reward": t_reward - t_generate,
        "time/train": t_end - t_reward,
        "time/step": t_end - t0,
        "time/sync": t_end - t_sync,
        "tokens_per_s": lengths.sum().item() / max(t_generate - t0, 1e-9),
        "mem/peak_gb": peak_memory_gb(),
    }
    if sampler is not None:
        metrics["sampler_logprob_gap/mean"] = gap_sum / full_mask.sum().item()
        metrics["sampler_logprob_gap/max"] = gap_max
    samples = [
        {"step": step, "prompt": group_rows[i]["prompt"], "completion": completions[i],
         "reward": rewards[i].item(), "reward_parts": {k: v[i] for k, v in parts.items()},
         "advantage": advantages[i].item(), "truncated": rollout.truncated[i]}
        for i in range(len(completions))
    ]
    return metrics, samples


def render_prompt(tokenizer, prompt: str | list[dict]) -> str:
    """A prompt as the model sees it: through its chat template when it has one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages) + "\n"


def pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Prompts padded on the left and completions on the right, so all completions start at one column.

    Returns input ids [b, Lp + T], attention mask [b, Lp + T], and the completion mask [b, T]."""
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids, attention, mask = [], [], []
    for p, c in rows:
        left, right = width_p - len(p), width_c - len(c)
        ids.append([pad_id] * left + p + c + [pad_id] * right)
        attention.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        mask.append([1] * len(c) + [0] * right)
    as_tensor = lambda x: torch.tensor(x, device=device)  # noqa: E731
    return as_tensor(ids), as_tensor(attention), as_tensor(mask).bool()


class PromptSampler:
    """Rows in a seeded random order, epoch after epoch."""

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("the task has no data rows")
        self.rows, self.rng, self.order = rows, random.Random(seed), []

    def draw(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            if not self.order:
                self.order = self.rng.sample(range(len(self.rows)), len(self.rows))
            out.append(self.rows[self.order.pop()])
        return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_gb() -> float:
    """Peak GPU memory where there is a GPU, else the process's peak resident memory."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # linux reports KiB
