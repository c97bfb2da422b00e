"""The GRPO loop. One step, top to bottom:

    prompts -> G completions each -> rewards -> group-relative advantages
            -> (reference log-probs) -> clipped loss, backward, optimizer step -> sync the generator -> log

What it keeps of GRPO (DeepSeekMath): groups of G samples per prompt, advantages relative to the group,
the PPO-clipped ratio against the sampling-time policy, and an optional k3 KL to the reference (the base
with its adapters disabled). What it drops: a value model, and a separate reference copy. The loss
variants (Dr. GRPO, DAPO, BNPO) are settings of two knobs in minigrpo/loss.py, not code paths here.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from minigrpo import checkpoint
from minigrpo import loss as L
from minigrpo.config import PRESETS, TrainConfig
from minigrpo.console import Display
from minigrpo.generation import Generator
from minigrpo.model import lora_parameters, pad_batch, seed_everything, token_logprobs
from minigrpo.rollout import PromptPool, collect
from minigrpo.run import RunFolder
from minigrpo.scoring import score
from minigrpo.check import precheck_rewards
from minigrpo.startup import check_lengths, load_for_training
from minigrpo.tasks import Task, check_sandbox, get_task

GAP_WARNING = 0.05  # mean |sampler - trainer| log-prob per token above which the engine is out of sync


def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Train a LoRA adapter with GRPO as `cfg` says; returns the run folder. With `resume`, continue the
    run in cfg.output_dir from its latest complete checkpoint, exactly where it stopped."""
    seed_everything(cfg.seed)
    task = get_task(cfg.task, cfg.rewards)
    check_sandbox(task, cfg.allow_unconfined_code, print)
    weights = cfg.reward_weights or task.weights
    if len(weights) != len(task.rewards):
        raise ValueError(f"{len(weights)} reward weights for the {len(task.rewards)} reward functions "
                         f"{task.reward_names}")
    train_rows = task.make_data("train", cfg.seed)
    # a broken reward, a bad row, a folder that is not ours: all stop here, before any model loads
    notes = precheck_rewards(task, weights, train_rows, cfg.reward_timeout)
    run = RunFolder(Path(cfg.output_dir), cfg.report_to) if resume else RunFolder.claim(cfg)
    check_lengths(cfg, task)
    display = Display(cfg.steps)
    display.print(f"[bold]minigrpo[/] {cfg.model} on {task.name}: {cfg.prompts_per_step} prompts x "
                  f"{cfg.num_generations} completions per step, {cfg.steps} steps -> {run.path}")
    for note in notes:
        display.print(f"[yellow]warning[/]: {note}", highlight=False)

    loaded = load_for_training(cfg, display.print)
    if not resume:
        run.start(cfg)  # written only now that the run can start
    model, tokenizer, generator = loaded.model, loaded.tokenizer, loaded.generator
    try:
        return _train(cfg, resume, task, weights, train_rows, run, display, model, tokenizer, generator,
                      loaded.dtype)
    finally:
        generator.close()  # frees the engine, so a second run in this process (a notebook cell re-run) can start one


def _train(cfg, resume, task, weights, train_rows, run, display, model, tokenizer, generator, dtype) -> Path:
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    # float16 gradients underflow; the scaler multiplies the loss up and divides the gradients back down
    scaler = torch.amp.GradScaler(model.device.type, enabled=dtype == torch.float16)
    prompts = PromptPool(train_rows, cfg.seed, cfg.retire_solved)
    evaluate = None
    if cfg.eval_every:
        from minigrpo.evaluate import Evaluator

        evaluate = Evaluator(cfg, task, weights, tokenizer, generator, run.path)
    loaded_gb = memory_in_use_gb()  # the model, the engine and the data: what a step's peak stands on
    done = 0
    if resume:
        found, done = checkpoint.load_newest(run.path, model, optimizer, scheduler, prompts, generator, scaler,
                                             display.print)
        checkpoint.truncate_logs(run.path, done, display.print)
        display.print(f"resumed from {found} (step {done})")

    if evaluate and done == 0:
        display.eval(evaluate(0))  # before any training: the baseline every later evaluation is read against

    def save(at: int) -> Path:
        return checkpoint.save(run.path, at, model, optimizer, scheduler, prompts, generator, cfg.keep, scaler)

    stop = StopRequest()
    step, bad_in_a_row = done, 0
    try:
        with display, stop:
            for step in range(done + 1, cfg.steps + 1):
                try:
                    metrics, samples = train_step(cfg, step, model, tokenizer, generator, optimizer, scheduler,
                                                  task, weights, prompts, scaler)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    display.print(out_of_memory_advice(cfg))
                    save(step - 1)
                    raise
                metrics["mem/loaded_gb"] = loaded_gb
                run.log(metrics, samples)
                display.step(metrics)
                bad_in_a_row = bad_in_a_row + 1 if metrics.get("skipped_nonfinite") else 0
                if bad_in_a_row:
                    display.print(f"[yellow]warning[/]: step {step}: the loss or gradient was NaN or inf; "
                                  f"the update was skipped ({bad_in_a_row} in a row)")
                if bad_in_a_row >= cfg.max_bad_steps:
                    save(step)
                    raise RuntimeError(f"{bad_in_a_row} steps in a row had a NaN or inf loss or gradient: lower "
                                       f"--learning-rate (now {cfg.learning_rate:g}) or check the rewards for "
                                       f"extreme values; the last good state is saved in {run.path}")
                if metrics.get("sampler_logprob_gap/mean", 0.0) > GAP_WARNING:
                    display.print(f"[bold red]warning[/]: the generator's log-probs differ from the trainer's by "
                                  f"{metrics['sampler_logprob_gap/mean']:.3f} per token on average: its weights "
                                  f"are stale or wrong, and samples are off-policy")
                if cfg.sample_every and samples and (step == 1 or step % cfg.sample_every == 0):
                    display.sample(step, random.Random(step).choice(samples))
                if evaluate and (step % cfg.eval_every == 0 or step == cfg.steps):
                    display.eval(evaluate(step))
                if stop.requested:
                    save(step)
                    display.print(f"[yellow]stopped after step {step} ({stop.requested}); checkpoint saved. "
                                  f"Resume with: minigrpo train --resume {run.path}[/]")
                    break
                if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    save(step)
    except KeyboardInterrupt:
        display.print(f"[yellow]interrupted during step {step}; the adapter is saved, and the run resumes from "
                      f"its last checkpoint with: minigrpo train --resume {run.path}[/]")
    except Exception:
        display.print(f"[red]step {step} failed; saving the adapter before stopping[/]")
        run.save_adapter(model)
        raise
    adapter = run.save_adapter(model)
    display.print(f"adapter saved to {adapter}")
    return run.path


class StopRequest:
    """SIGINT (Ctrl-C) or SIGTERM: finish the current step, save a checkpoint, stop. A second one stops at
    once (KeyboardInterrupt), and the run resumes from its last checkpoint."""

    def __init__(self):
        self.requested: str | None = None
        self.previous = {}

    def __enter__(self) -> "StopRequest":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing this step, then saving a checkpoint (send it again to stop at once)",
              flush=True)


# torch's cpu allocator says "can't allocate memory"; a cuda call failing inside a library (vLLM mapping its
# memory back at wake-up) raises "CUDA error: out of memory"
OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU out-of-memory error, Python's MemoryError, or an allocator failing inside a library (a
    RuntimeError whose text says so, as torch's cpu allocator and vLLM's wake-up raise it)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_TEXTS))


def out_of_memory_advice(cfg: TrainConfig) -> str:
    used = f"peak {peak_memory_gb():.1f} GB" + (
        f" of {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GB" if torch.cuda.is_available() else "")
    return (f"[bold red]out of memory[/] ({used}). Lower one of: --num-generations (now {cfg.num_generations}), "
            f"--max-new-tokens (now {cfg.max_new_tokens}), --micro-batch-size (now {cfg.micro_batch_size}), "
            f"--prompts-per-step (now {cfg.prompts_per_step})"
            + (f", or the engine's --gpu-memory-utilization (now {cfg.gpu_memory_utilization})"
               if cfg.generator != "hf" else "") + ". The last completed step is saved; resume with --resume. "
            + (f"`minigrpo bench model --model {cfg.model}` measures which settings fit." if cfg.model in PRESETS
               else ""))


def train_step(cfg: TrainConfig, step: int, model, tokenizer, generator: Generator, optimizer, scheduler,
               task: Task, weights: list[float], prompts: PromptPool, scaler) -> tuple[dict, list[dict]]:
    """One GRPO step; returns the step's metrics and its samples."""
    G = cfg.num_generations
    t0 = time.perf_counter()

    # 1. sample G completions per prompt, and score them
    batch, info = collect(cfg, tokenizer, generator, task, weights, prompts)
    batch_seconds = (info.pop("generate_s"), info.pop("reward_s"))
    t_rollout = time.perf_counter()
    if not batch.rows:  # every group had equal rewards, even after refilling: nothing to learn from
        return {"step": step, **info, "skipped": 1, "time/step": t_rollout - t0, "time/generate": batch_seconds[0],
                "mem/peak_gb": peak_memory_gb(), **prompts.metrics()}, []

    # 2. advantages within each group
    rewards = torch.tensor(batch.scores.totals)  # [B]
    advantages = L.advantages(rewards, G, cfg.scale_rewards)  # [B]

    # 3. loss and backward, micro-batch by micro-batch so memory does not grow with B
    model.train()
    pairs = [(batch.prompt_ids[i // G], c) for i, c in enumerate(batch.completion_ids)]
    lengths = torch.tensor([len(c) for c in batch.completion_ids])  # [B]
    full_mask = torch.arange(lengths.max())[None, :] < lengths[:, None]  # [B, T]
    if cfg.mask_truncated:
        full_mask &= ~torch.tensor(batch.truncated)[:, None]  # [B, T]
    sampler = padded(batch.sampler_logps, full_mask.shape) if batch.sampler_logps is not None else None  # [B, T]
    chunks = [slice(s, s + cfg.micro_batch_size) for s in range(0, len(pairs), cfg.micro_batch_size)]
    inputs = [pad_batch(pairs[c], tokenizer.pad_token_id, model.device) for c in chunks]  # (ids, attention, mask)
    masks = [full_mask[c, :m.shape[1]].to(model.device) & m for c, (_, _, m) in zip(chunks, inputs)]

    old_logps = [None] * len(chunks)
    if cfg.num_iterations > 1:  # the sampling-time policy, kept fixed across the passes
        with torch.no_grad():
            old_logps = [token_logprobs(model, ids, att, m.shape[1], cfg.temperature, cfg.logprob_chunk_size)
                         for ids, att, m in inputs]
    ref_logps = [None] * len(chunks)
    t_reference = time.perf_counter()
    if cfg.beta > 0:
        with torch.no_grad(), model.disable_adapter():
            ref_logps = [token_logprobs(model, ids, att, m.shape[1], cfg.temperature, cfg.logprob_chunk_size)
                         for ids, att, m in inputs]

    t_reference = time.perf_counter() - t_reference
    totals = dict.fromkeys(("loss", "kl", "clip_frac", "ratio/mean", "entropy"), 0.0)
    nonfinite, overflows = False, 0
    gap_sum, gap_max, grad_norms = 0.0, 0.0, []
    for iteration in range(cfg.num_iterations):
        pass_loss = 0.0
        for c, (ids, attention, _), mask, old, ref in zip(chunks, inputs, masks, old_logps, ref_logps):
            n = mask.shape[1]
            logps, entropy = token_logprobs(model, ids, attention, n, cfg.temperature, cfg.logprob_chunk_size,
                                            with_entropy=True)  # [b, n], [b, n]
            old = logps.detach() if old is None else old  # one pass: the sampling policy is the current one
            sampler_logps = sampler[c, :n].to(logps.device) if sampler is not None else None  # [b, n]
            loss, m = L.policy_loss(logps, old, ref, advantages[c].to(logps.device), mask, epsilon=cfg.epsilon,
                                    epsilon_high=cfg.epsilon_high, beta=cfg.beta, aggregation=cfg.loss_aggregation,
                                    max_tokens=cfg.max_new_tokens, sampler_logps=sampler_logps, tis_cap=cfg.tis_cap)
            weight = L.microbatch_weight(mask, full_mask, cfg.loss_aggregation)
            scaler.scale(loss * weight).backward()
            pass_loss += loss.item() * weight
            if iteration == cfg.num_iterations - 1:  # report the last pass
                share = mask.sum().item() / max(full_mask.sum().item(), 1)
                totals["entropy"] += L.masked_mean(entropy, mask) * share
                for key in ("kl", "clip_frac", "ratio/mean"):
                    totals[key] += m[key] * share
            if sampler_logps is not None and iteration == 0:
                gap = (logps.detach() - sampler_logps).abs()[mask]  # [tokens]
                gap_sum += gap.sum().item()
                gap_max = max(gap_max, gap.max().item()) if gap.numel() else gap_max
        grad_norm, outcome = apply_update(optimizer, scaler, cfg.max_grad_norm, pass_loss)
        grad_norms.append(grad_norm)
        overflows += outcome == "overflow"
        nonfinite |= outcome == "nonfinite"
        totals["loss"] = pass_loss  # the last pass's
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    t_sync = time.perf_counter()
    generator.sync(model)
    t_end = time.perf_counter()

    # 4. log
    metrics = {
        "step": step,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        **{f"reward/{name}/mean": mean_of_present(values) for name, values in batch.scores.values.items()},
        **{f"reward/{name}/mean": float(np.mean(values)) for name, values in batch.scores.parts.items()},
        **{f"reward/{name}/errors": count for name, count in batch.scores.errors.items()},
        **info,
        **totals,
        "completion_len/mean": lengths.float().mean().item(),
        "completion_len/max": lengths.max().item(),
        "prompt_len/max": max(len(p) for p in batch.prompt_ids),
        "truncated_frac": float(np.mean(batch.truncated)),
        "lr": lr,
        "grad_norm": float(np.mean(grad_norms)),
        "time/generate": batch_seconds[0],  # with any extra filter rounds
        "time/reward": batch_seconds[1],
        "time/train": t_sync - t_rollout,  # reference pass, forward, backward and optimizer
        "time/reference": t_reference,
        "time/sync": t_end - t_sync,
        "time/step": t_end - t0,
        "tokens_per_s": info["tokens_generated"] / max(batch_seconds[0], 1e-9),
        "mem/peak_gb": peak_memory_gb(),
        **reserved_memory_gb(),
        **prompts.metrics(),
    }
    if nonfinite:
        metrics["skipped_nonfinite"] = 1
    if scaler.is_enabled():
        metrics["grad_scale"] = scaler.get_scale()
        metrics["skipped_overflow"] = overflows
    if sampler is not None:
        metrics["sampler_logprob_gap/mean"] = gap_sum / max(full_mask.sum().item(), 1)
        metrics["sampler_logprob_gap/max"] = gap_max
    parts = batch.scores.values | batch.scores.parts
    samples = [
        {"step": step, "prompt": batch.rows[i // G]["prompt"], "completion": batch.completions[i],
         "reward": rewards[i].item(), "reward_parts": {k: v[i] for k, v in parts.items()},
         "advantage": advantages[i].item(), "truncated": batch.truncated[i]}
        for i in range(len(batch.completions))
    ]
    return metrics, samples


def apply_update(optimizer, scaler, max_grad_norm: float, loss: float) -> tuple[float, str]:
    """Clip and apply the accumulated gradients; returns the gradient norm and "applied", "overflow" (float16
    gradients overflowed at the scaler's scale: it lowers the scale and the update is skipped, as expected
    while it calibrates) or "nonfinite" (a NaN or inf that would poison the adapter and adam's moments: skipped,
    and counted towards --max-bad-steps)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler.unscale_(optimizer)  # a no-op without float16
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf")).item()
    if np.isfinite(norm) and np.isfinite(loss):
        scaler.step(optimizer)
        outcome = "applied"
    elif np.isfinite(loss) and scaler.is_enabled() and scaler.get_scale() >= 1:
        outcome = "overflow"
    else:
        outcome = "nonfinite"
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm, outcome


def mean_of_present(values: list[float | None]) -> float | None:
    """The mean over the completions a reward applies to (None: does not apply)."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def padded(rows: list[list[float]], shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape)  # [B, T]
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:shape[1]])
    return out


def peak_memory_gb() -> float:
    """Peak GPU memory where there is a GPU, else the process's peak resident memory."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource
    except ImportError:  # Windows has no getrusage
        return 0.0
    kib_or_bytes = 2**30 if sys.platform == "darwin" else 2**20  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib_or_bytes


def reserved_memory_gb() -> dict:
    """On a GPU, the peak of what torch's allocator reserved from the card (allocated plus its cache): what
    other users of the card, such as the vLLM engine, could not have. Nothing on a cpu."""
    if not torch.cuda.is_available():
        return {}
    return {"mem/peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}


def memory_in_use_gb() -> float:
    """GPU memory allocated now where there is a GPU, else the process's resident set now."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**30
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # no /proc (macOS): the peak so far is the closest figure
        return peak_memory_gb()
