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
import time
from pathlib import Path

import numpy as np
import torch

from minigrpo import checkpoint, fork, hacking, settle
from minigrpo.judge import rubric as judge
from minigrpo.adapters import refuse_foreign_adapters
from minigrpo import loss as L
from minigrpo.check import precheck_rewards
from minigrpo.config import TrainConfig
from minigrpo.console import Display, quiet_libraries
from minigrpo.errors import Stopped
from minigrpo.evaluate import Evaluator
from minigrpo.hardware import memory_in_use_gb, peak_memory_gb, reserved_memory_gb
from minigrpo.health import StopRequest, warn_or_stop, is_out_of_memory, out_of_memory_advice
from minigrpo.model import seed_everything
from minigrpo.plot import read_jsonl
from minigrpo.rollout import collect
from minigrpo.run import LockLost, RunFolder
from minigrpo.state import PromptPool, RunState
from minigrpo.startup import load_for_training, settle_run
from minigrpo.supervise import progress
from minigrpo.tasks import Task, refuse_unconfined_code, get_task
from minigrpo.update import MicroBatches, Update, micro_batches, policy_update



def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Train a LoRA adapter with GRPO as `cfg` says; returns the run folder. With `resume`, continue the
    run in cfg.output_dir from its latest complete checkpoint, exactly where it stopped."""
    quiet_libraries()  # before a reward's TrainerState imports transformers' trainer, and with it bitsandbytes
    seed_everything(cfg.seed)
    progress(stage="checking the task and its rewards")
    task = settle.run_task(get_task(cfg.task, cfg.rewards, extra_tools=cfg.tools, environment=cfg.environment), cfg)
    refuse_unconfined_code(task, cfg.allow_unconfined_code, print)
    train_rows = task.make_data("train", cfg.seed)
    # a broken reward, a bad row, a folder that is not ours, weights out of reach, a run that cannot fit: all stop
    # here, before any model loads or a run folder is made
    notes = precheck_rewards(task, train_rows, cfg.reward_timeout)
    refuse_foreign_adapters(cfg)
    said = []  # the plan's line, shown under the run's first line
    prepared, settled_notes = settle_run(cfg, task, train_rows, said.append)
    cfg = prepared.cfg
    run = RunFolder(Path(cfg.output_dir), cfg.report_to) if resume else RunFolder.claim(cfg)
    if resume:
        run.lock()  # before the model loads: a second process on this folder stops here, in one line
    try:
        return _load_and_train(prepared, resume, task, train_rows, notes + settled_notes, said, run)
    finally:
        run.unlock()


def _load_and_train(prepared, resume, task, train_rows, notes, said, run) -> Path:
    cfg = prepared.cfg
    display = Display(cfg.steps)
    display.print(f"[bold]minigrpo[/] {cfg.model} on {task.name}: {cfg.prompts_per_step} prompts x "
                  f"{cfg.num_generations} completions per step, {cfg.steps} step{'s' * (cfg.steps != 1)} -> {run.path}")
    for note in notes:
        display.print(f"[yellow]warning[/]: {note}", highlight=False)
    for line in said:
        display.print(line)

    progress(run=str(run.path), stage="loading the model")
    loaded = load_for_training(prepared, display.print)
    if not resume:
        run.start(cfg)  # written only now that the run can start
        if cfg.forked_from:
            fork.seed_folder(run.path, cfg.forked_from)
    state = RunState.start(cfg, loaded.model, loaded.tokenizer, loaded.generator, loaded.dtype, train_rows)
    judge.attach(judge.base_generate(state.generator, state.tokenizer), run.path)  # judges grade with the base
    try:
        return _train(cfg, resume, task, run, display, state)
    finally:
        judge.attach(None, None)
        state.generator.close()  # frees the engine, so a second run in this process (a notebook cell re-run) can start one


def _train(cfg: TrainConfig, resume: bool, task: Task, run: RunFolder, display: Display, state: RunState) -> Path:
    evaluate = None
    if cfg.eval_every or cfg.eval_before_after:
        evaluate = Evaluator(cfg, task, state.tokenizer, state.generator, run.path)
    full = bool(cfg.eval_every)  # sampled as well as greedy; the before/after alone is greedy
    loaded_gb = memory_in_use_gb()  # the model, the engine and the data: what a step's peak stands on
    done = _resume(cfg, resume, run, state, display)
    watch = hacking.replay(run.path, task)[0]  # a resumed run's detectors read its logs so far again

    if evaluate and done == 0:
        progress(step=0, stage="evaluating before training")
        watch.evaluation(evaluate(0, full))  # before any training: what every later evaluation is read against
        display.eval(watch.evals[-1])

    objective = L.Objective.of(cfg)  # the loss's fixed settings, bound once
    stop = StopRequest()
    display.on_reader_gone = lambda: stop.request("the output's reader went away")
    if display.reader_gone:  # it went while the model loaded
        display.on_reader_gone()

    def save(at: int) -> Path:
        progress(step=at, stage="saving a checkpoint")
        stop.where = f"saving step {at}'s checkpoint"
        run.refuse_if_lock_lost()
        return checkpoint.save(run.path, at, state, cfg.keep)

    step, bad_in_a_row, halted = done, 0, None  # halted: (the step saved, how) where the run stops before its end
    run.clear_stopped()  # a resumed run is running again
    try:
        with display, stop:
            for step in range(done + 1, cfg.steps + 1):
                stop.where = f"step {step}"
                display.stage(step)
                try:
                    metrics, samples = train_step(cfg, objective, step, state, task)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    display.print(out_of_memory_advice(cfg))
                    save(step - 1)
                    raise
                metrics["mem/loaded_gb"] = loaded_gb
                display.step(metrics)
                if evaluate and (step == cfg.steps or (full and step % cfg.eval_every == 0)):
                    progress(step=step, stage="evaluating")
                    stop.where = f"the evaluation after step {step}"
                    watch.evaluation(evaluate(step, full))
                    display.eval(watch.evals[-1])
                gamed = watch.see(metrics, samples)  # before the log: it adds the hacking/* metrics
                run.log(metrics, samples + [finding.record() for finding in gamed])
                bad_in_a_row = warn_or_stop(cfg, metrics, bad_in_a_row, display, lambda: save(step), run.path)
                for finding in gamed:
                    display.gamed(finding)
                    if cfg.stop_on_hacking:
                        stop.request(f"--stop-on-hacking: the {finding.detector} detector fired")
                if cfg.sample_every and samples and (step == 1 or step % cfg.sample_every == 0):
                    display.sample(step, random.Random(step).choice(samples))
                if stop.requested and step < cfg.steps:
                    save(step)
                    halted = step, stop.requested
                    break
                if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    save(step)
    except KeyboardInterrupt:  # a second signal: at once, from the last checkpoint
        saved = checkpoint.candidates(run.path)
        halted = int(saved[0].name.removeprefix("step-")) if saved else 0, f"{stop.requested or 'interrupted'}, at once"
    except LockLost:
        raise  # another process may own the folder now: nothing more is written
    except Exception:
        display.print(f"[red]step {step} failed; saving the adapter before stopping[/]")
        run.save_adapter(state.model)
        raise
    if halted:
        stopped(run, *halted, display)
    adapter = run.save_adapter(state.model)
    display.print(f"adapter saved to {adapter}")
    display.before_after(read_jsonl(run.path / "eval.jsonl"), cfg.eval_data)
    return run.path


def _resume(cfg: TrainConfig, resume: bool, run: RunFolder, state: RunState, display: Display) -> int:
    """Load a resumed (or forked) run's newest checkpoint into `state` and cut its logs back to it; returns
    the steps it had done."""
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
    return done


def stopped(run: RunFolder, saved_step: int, how: str, display: Display) -> None:
    """A run stopped before its last step: the folder says so (no final adapter), and so does the exit status."""
    run.mark_stopped(saved_step, how)
    saved = f"its last checkpoint is step {saved_step}" if saved_step else "no checkpoint was saved yet"
    display.print(f"[yellow]stopped ({how}); {saved}, and no final adapter was written. Finish it with: minigrpo "
                  f"train --resume {run.path}[/]")
    raise Stopped(f"stopped ({how})")


def train_step(cfg: TrainConfig, objective: L.Objective, step: int, state: RunState,
               task: Task) -> tuple[dict, list[dict]]:
    """One GRPO step, in its stages, advancing `state`; returns the step's metrics and its samples."""
    model, tokenizer, generator, prompts, entropy = state.model, state.tokenizer, state.generator, state.prompts, \
        state.entropy
    took, started = {}, time.perf_counter()  # seconds each stage took (`collect` times generation and rewards)

    # 1. rollout: G completions per prompt, scored (with --filter-groups, only groups with spread)
    progress(step=step, stage="rollout")
    batch, info = collect(cfg, state, task, step)
    took["generate"], took["reward"], took["rollout"] = info.pop("generate_s"), info.pop("reward_s"), \
        time.perf_counter() - started
    if not batch.rows:  # every group had equal rewards, even after refilling: nothing to learn from
        return {"step": step, **info, "skipped": 1, "time/step": took["rollout"], "time/generate": took["generate"],
                "mem/peak_gb": peak_memory_gb(), **prompts.metrics()}, []

    # 2. advantages within each group
    rewards = torch.tensor(batch.scores.totals)  # [B]
    advantages = step_advantages(cfg, batch, task.weights)  # [B]

    # 3. policy update: (reference log-probs,) clipped loss, backward, optimizer, micro-batch by micro-batch
    progress(step=step, stage="update")
    model.train()
    generator.release()  # what the generator holds only to generate (its engine's or decoder's memory) goes back
    mb = micro_batches(cfg, batch, tokenizer.pad_token_id, model.device)
    update = policy_update(cfg, objective, model, mb, advantages, state.optimizer, state.scaler, entropy.applied())
    update.totals["entropy_coef"] = entropy.applied()
    entropy.step(update.totals["entropy"])
    lr = state.optimizer.param_groups[0]["lr"]  # the rate this step used (a fork sets its own)
    state.scheduler.step()
    took["update"] = time.perf_counter() - started - took["rollout"]

    # 4. the generator gets the new adapter
    progress(step=step, stage="sync")
    generator.sync(model)
    took["sync"] = time.perf_counter() - started - took["rollout"] - took["update"]

    # 5. metrics and samples
    metrics = step_metrics(step, batch, info, rewards, mb, update, lr, took, state.scaler, prompts)
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
                 took: dict, scaler, prompts: PromptPool) -> dict:
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
        "time/generate": took["generate"],  # with any extra filter rounds
        "time/reward": took["reward"],
        "time/train": took["update"],  # reference pass, forward, backward and optimizer
        "time/reference": update.reference_s,
        "time/sync": took["sync"],
        "time/step": took["rollout"] + took["update"] + took["sync"],
        "tokens_per_s": info["tokens_generated"] / max(took["generate"], 1e-9),
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
