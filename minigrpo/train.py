"""The GRPO loop. One step, top to bottom:

    prompts -> G completions each -> rewards -> group-relative advantages
            -> (reference log-probs) -> clipped loss, backward, optimizer step -> sync the generator -> log

What it keeps of GRPO (DeepSeekMath): groups of G samples per prompt, advantages relative to the group,
the PPO-clipped ratio against the sampling-time policy, and an optional k3 KL to the reference (the base
with its adapters disabled). What it drops: a value model, and a separate reference copy. The loss
variants (Dr. GRPO, DAPO, BNPO) are settings of two knobs in minigrpo/loss.py, not code paths here.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import numpy as np
import torch

from minigrpo import checkpoint, fork
from minigrpo.judge import rubric as judge
from minigrpo.adapters import check_adapter
from minigrpo import loss as L
from minigrpo.check import precheck_rewards
from minigrpo.config import PRESETS, TrainConfig
from minigrpo.console import Display, quiet_libraries
from minigrpo.episodes import settle_budget
from minigrpo.evaluate import Evaluator, settle_evaluation
from minigrpo.hardware import memory_in_use_gb, peak_memory_gb, reserved_memory_gb
from minigrpo.model import seed_everything
from minigrpo.plot import read_jsonl
from minigrpo.rollout import PromptPool, collect
from minigrpo.run import RunFolder
from minigrpo.state import RunState
from minigrpo.startup import load_for_training
from minigrpo.supervise import progress
from minigrpo.tasks import Task, check_sandbox, get_task
from minigrpo.update import MicroBatches, Update, micro_batches, policy_update
from minigrpo.weights import resolve_weights

GAP_WARNING = 0.05  # mean |sampler - trainer| log-prob per token above which the engine is out of sync
FLAT_STEPS = 5  # steps in a row without a group whose rewards differ, before a run is told it learns nothing


def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Train a LoRA adapter with GRPO as `cfg` says; returns the run folder. With `resume`, continue the
    run in cfg.output_dir from its latest complete checkpoint, exactly where it stopped."""
    quiet_libraries()  # before a reward's TrainerState imports transformers' trainer, and with it bitsandbytes
    seed_everything(cfg.seed)
    progress(stage="checking the task and its rewards")
    task = get_task(cfg.task, cfg.rewards, extra_tools=cfg.tools, environment=cfg.environment)
    settle_budget(cfg, task)
    check_sandbox(task, cfg.allow_unconfined_code, print)
    weights = cfg.reward_weights or task.weights
    if len(weights) != len(task.rewards):
        raise ValueError(f"{len(weights)} reward weights for the {len(task.rewards)} reward functions "
                         f"{task.reward_names}")
    train_rows = task.make_data("train", cfg.seed)
    # a broken reward, a bad row, a folder that is not ours, weights out of reach: all stop here, before any
    # model loads or a run folder is made
    notes = precheck_rewards(task, weights, train_rows, cfg.reward_timeout)
    check_adapter(cfg)
    notes += filter(None, [settle_evaluation(cfg, task, train_rows)])
    resolve_weights(cfg.hub_id)
    run = RunFolder(Path(cfg.output_dir), cfg.report_to) if resume else RunFolder.claim(cfg)
    if resume:
        run.lock()  # before the model loads: a second process on this folder stops here, in one line
    try:
        return _load_and_train(cfg, resume, task, weights, train_rows, notes, run)
    finally:
        run.unlock()


def _load_and_train(cfg, resume, task, weights, train_rows, notes, run) -> Path:
    display = Display(cfg.steps)
    display.print(f"[bold]minigrpo[/] {cfg.model} on {task.name}: {cfg.prompts_per_step} prompts x "
                  f"{cfg.num_generations} completions per step, {cfg.steps} step{'s' * (cfg.steps != 1)} -> {run.path}")
    for note in notes:
        display.print(f"[yellow]warning[/]: {note}", highlight=False)

    progress(run=str(run.path), stage="loading the model")
    loaded = load_for_training(cfg, display.print, task)
    if not resume:
        run.start(cfg)  # written only now that the run can start
        if cfg.forked_from:
            fork.seed_folder(run.path, cfg.forked_from)
    state = RunState.start(cfg, loaded.model, loaded.tokenizer, loaded.generator, loaded.dtype, train_rows)
    judge.attach(judge.base_generate(state.generator, state.tokenizer), run.path)  # judges grade with the base
    try:
        return _train(cfg, resume, task, weights, run, display, state)
    finally:
        judge.attach(None, None)
        state.generator.close()  # frees the engine, so a second run in this process (a notebook cell re-run) can start one


def _train(cfg: TrainConfig, resume: bool, task: Task, weights: list[float], run: RunFolder, display: Display,
           state: RunState) -> Path:
    evaluate = None
    if cfg.eval_every or cfg.eval_before_after:
        evaluate = Evaluator(cfg, task, weights, state.tokenizer, state.generator, run.path)
    full = bool(cfg.eval_every)  # sampled as well as greedy; the before/after alone is greedy
    loaded_gb = memory_in_use_gb()  # the model, the engine and the data: what a step's peak stands on
    done, resume = 0, resume or bool(cfg.forked_from)  # a fork resumes from its parent's checkpoint
    if resume and checkpoint.candidates(run.path):
        found, done = checkpoint.load_newest(run.path, state, display.print)
        if cfg.forked_from:
            fork.apply_changes(cfg, state.optimizer, state.scheduler)
        display.print(f"resumed from {found} (step {done})")
    elif resume:  # it stopped before its first checkpoint
        display.print(f"{run.path} has no checkpoint yet: starting it from step 0")
    if resume:  # from step 0, its baseline evaluation is redone too
        checkpoint.truncate_logs(run.path, done or -1, display.print)

    if evaluate and done == 0:
        progress(step=0, stage="evaluating before training")
        display.eval(evaluate(0, full))  # before any training: the baseline every later evaluation is read against

    def save(at: int) -> Path:
        progress(step=at, stage="saving a checkpoint")
        return checkpoint.save(run.path, at, state, cfg.keep)

    stop = StopRequest()
    step, bad_in_a_row = done, 0
    try:
        with display, stop:
            for step in range(done + 1, cfg.steps + 1):
                display.stage(step)
                try:
                    metrics, samples = train_step(cfg, step, state, task, weights)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    display.print(out_of_memory_advice(cfg))
                    save(step - 1)
                    raise
                metrics["mem/loaded_gb"] = loaded_gb
                run.log(metrics, samples)
                display.step(metrics)
                bad_in_a_row = check_health(cfg, metrics, bad_in_a_row, display, lambda: save(step), run.path)
                if cfg.sample_every and samples and (step == 1 or step % cfg.sample_every == 0):
                    display.sample(step, random.Random(step).choice(samples))
                if evaluate and (step == cfg.steps or (full and step % cfg.eval_every == 0)):
                    progress(step=step, stage="evaluating")
                    display.eval(evaluate(step, full))
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
        run.save_adapter(state.model)
        raise
    adapter = run.save_adapter(state.model)
    display.print(f"adapter saved to {adapter}")
    display.before_after(read_jsonl(run.path / "eval.jsonl"), cfg.eval_data)
    return run.path


def check_health(cfg: TrainConfig, metrics: dict, bad_in_a_row: int, display: Display, save, where: Path) -> int:
    """Warn about a skipped NaN update (and stop after max_bad_steps in a row, saved), about steps with nothing
    to learn from (no group's rewards differ), and about a generator whose log-probs drift from the trainer's;
    returns the NaN steps in a row so far."""
    bad_in_a_row = bad_in_a_row + 1 if metrics.get("skipped_nonfinite") else 0
    if bad_in_a_row:
        display.print(f"[yellow]warning[/]: step {metrics['step']}: the loss or gradient was NaN or inf; "
                      f"the update was skipped ({bad_in_a_row} in a row)")
    if bad_in_a_row >= cfg.max_bad_steps:
        save()
        raise RuntimeError(f"{bad_in_a_row} steps in a row had a NaN or inf loss or gradient: lower "
                           f"--learning-rate (now {cfg.learning_rate:g}) or check the rewards for "
                           f"extreme values; the last good state is saved in {where}")
    if metrics.get("maxrl/groups_below_zero") and "maxrl" not in display.warned:
        display.warned.add("maxrl")  # once a run: it is a property of the rewards, not of one step
        display.print(f"[yellow]warning[/]: step {metrics['step']}: {metrics['maxrl/groups_below_zero']} group(s) had "
                      f"rewards below 0; --advantage maxrl reads rewards as successes in [0, 1] and gives a group "
                      f"whose mean is 0 or less advantage 0: use --advantage grpo or rloo with such rewards")
    display.flat_steps = 0 if metrics.get("frac_groups_reward_differs") else display.flat_steps + 1
    if display.flat_steps == FLAT_STEPS and "flat" not in display.warned:
        display.warned.add("flat")
        display.print(f"[yellow]warning[/]: no group has had reward spread for {FLAT_STEPS} steps: every completion of "
                      f"a prompt scored the same, and GRPO learns only from differences within a group. See what "
                      f"the model writes and scores with `minigrpo check-reward --task {cfg.task} --model {cfg.model}`; "
                      f"a small model may need worked examples in its prompt (an rg: task takes shots=2), a longer "
                      f"--max-new-tokens (now {cfg.max_new_tokens}), or a reward for the format", highlight=False)
    if metrics.get("sampler_logprob_gap/mean", 0.0) > GAP_WARNING:
        display.print(f"[bold red]warning[/]: the generator's log-probs differ from the trainer's by "
                      f"{metrics['sampler_logprob_gap/mean']:.3f} per token on average: its weights "
                      f"are stale or wrong, and samples are off-policy")
    return bad_in_a_row


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


def train_step(cfg: TrainConfig, step: int, state: RunState, task: Task,
               weights: list[float]) -> tuple[dict, list[dict]]:
    """One GRPO step, in its stages, advancing `state`; returns the step's metrics and its samples."""
    model, tokenizer, generator, prompts, entropy = state.model, state.tokenizer, state.generator, state.prompts, \
        state.entropy
    clock = {"start": time.perf_counter()}

    # 1. rollout: G completions per prompt, scored (with --filter-groups, only groups with spread)
    progress(step=step, stage="rollout")
    batch, info = collect(cfg, tokenizer, generator, task, weights, prompts, step)
    clock["rollout"], clock["generate_s"], clock["reward_s"] = time.perf_counter(), info.pop("generate_s"), \
        info.pop("reward_s")
    if not batch.rows:  # every group had equal rewards, even after refilling: nothing to learn from
        return {"step": step, **info, "skipped": 1, "time/step": clock["rollout"] - clock["start"],
                "time/generate": clock["generate_s"], "mem/peak_gb": peak_memory_gb(), **prompts.metrics()}, []

    # 2. advantages within each group
    rewards = torch.tensor(batch.scores.totals)  # [B]
    advantages = step_advantages(cfg, batch, weights)  # [B]

    # 3. policy update: (reference log-probs,) clipped loss, backward, optimizer, micro-batch by micro-batch
    progress(step=step, stage="update")
    model.train()
    mb = micro_batches(cfg, batch, tokenizer.pad_token_id, model.device)
    update = policy_update(cfg, model, mb, advantages, state.optimizer, state.scaler, entropy.applied())
    update.totals["entropy_coef"] = entropy.applied()
    entropy.step(update.totals["entropy"])
    lr = state.optimizer.param_groups[0]["lr"]  # the rate this step used (a fork sets its own)
    state.scheduler.step()
    clock["update"] = time.perf_counter()

    # 4. the generator gets the new adapter
    progress(step=step, stage="sync")
    generator.sync(model)
    clock["sync"] = time.perf_counter()

    # 5. metrics and samples
    metrics = step_metrics(step, batch, info, rewards, mb, update, lr, clock, state.scaler, prompts)
    return metrics, samples_of(step, batch, rewards, advantages, cfg.num_generations)


def step_advantages(cfg: TrainConfig, batch, weights: list[float]) -> torch.Tensor:
    """Each completion's advantage [B], from the weighted total reward (or, with GDPO's aggregation, the
    rewards normalised one by one within their groups, then weighted and summed) by the chosen estimator."""
    if cfg.reward_aggregation == "sum":
        signal = torch.tensor(batch.scores.totals, dtype=torch.float)  # [B]
    else:
        values = torch.tensor([[v or 0.0 for v in vs] for vs in batch.scores.values.values()],
                              dtype=torch.float)  # [K, B]
        signal = L.combined_rewards(values, torch.tensor(weights, dtype=torch.float), cfg.num_generations,
                                    cfg.reward_aggregation)  # [B]
    return L.advantages(signal, cfg.num_generations, cfg.scale_rewards, cfg.advantage)  # [B]


def step_metrics(step: int, batch, info: dict, rewards, mb: MicroBatches, update: Update, lr: float,
                 clock: dict, scaler, prompts: PromptPool) -> dict:
    metrics = {
        "step": step,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        **{f"reward/{name}/mean": mean_of_present(values) for name, values in batch.scores.values.items()},
        **{f"reward/{name}/mean": float(np.mean(values)) for name, values in batch.scores.parts.items()},
        **{f"reward/{name}/errors": count for name, count in batch.scores.errors.items()},
        **{name: float(np.mean(values)) for name, values in batch.scores.metrics.items()},  # rewards' log_metric
        **info,
        **update.totals,
        "completion_len/mean": mb.lengths.float().mean().item(),
        "completion_len/max": mb.lengths.max().item(),
        "prompt_len/max": max(len(p) for p in batch.prompt_ids),
        "truncated_frac": float(np.mean(batch.truncated)),
        "lr": lr,
        "grad_norm": update.grad_norm,
        "time/generate": clock["generate_s"],  # with any extra filter rounds
        "time/reward": clock["reward_s"],
        "time/train": clock["update"] - clock["rollout"],  # reference pass, forward, backward and optimizer
        "time/reference": update.reference_s,
        "time/sync": clock["sync"] - clock["update"],
        "time/step": clock["sync"] - clock["start"],
        "tokens_per_s": info["tokens_generated"] / max(clock["generate_s"], 1e-9),
        "mem/peak_gb": peak_memory_gb(),
        **reserved_memory_gb(),
        **prompts.metrics(),
        **judge.step_metrics(),
    }
    if update.nonfinite:
        metrics["skipped_nonfinite"] = 1
    if scaler.is_enabled():
        metrics["grad_scale"] = scaler.get_scale()
        metrics["skipped_overflow"] = update.overflows
    if mb.sampler is not None:
        metrics["sampler_logprob_gap/mean"] = update.gap_sum / max(mb.full_mask.sum().item(), 1)
        metrics["sampler_logprob_gap/max"] = update.gap_max
        # the mean of exp(trainer - sampler) before its cap: 1 where both sides are one distribution
        metrics["importance_weight/mean"] = update.weight_sum / max(mb.full_mask.sum().item(), 1)
    return metrics


def samples_of(step: int, batch, rewards, advantages, G: int) -> list[dict]:
    """Every completion with its prompt, reward and parts, and advantage, for samples.jsonl."""
    parts = batch.scores.values | batch.scores.parts
    prompts = batch.prompts or [row["prompt"] for row in batch.rows]
    samples = [{"step": step, "prompt": prompts[i // G], "completion": batch.completions[i],
                "reward": rewards[i].item(), "reward_parts": {k: v[i] for k, v in parts.items()},
                "advantage": advantages[i].item(), "truncated": batch.truncated[i]}
               for i in range(len(batch.completions))]
    for column, values in batch.scores.extra.items():  # the rewards' log_extra columns
        for s, value in zip(samples, values):
            s.setdefault("extra", {})[column] = value
    if batch.model_masks is not None:  # episodes: the conversation after the prompt, with its counts
        for s in samples:
            s["turns"] = sum(m["role"] == "assistant" for m in s["completion"])
            s["tool_calls"] = sum(m["role"] == "tool" for m in s["completion"])
    return samples


def mean_of_present(values: list[float | None]) -> float | None:
    """The mean over the completions a reward applies to (None: does not apply)."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None
