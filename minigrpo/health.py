"""What a run watches in itself between steps, and how it stops: NaN steps (skipped, then a stop), groups with
no reward spread, a generator drifting from the trainer, running out of memory (named, with the flags that
lower it), and Ctrl-C or SIGTERM (the step finished and saved first)."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from minigrpo.config import TrainConfig
from minigrpo.presets import PRESETS
from minigrpo.console import Display
from minigrpo.hardware import peak_memory_gb

GAP_WARNING = 0.05  # mean |sampler - trainer| log-prob per token above which the engine is out of sync
FLAT_STEPS = 5  # steps in a row without a group whose rewards differ, before a run is told it learns nothing


def warn_or_stop(cfg: TrainConfig, metrics: dict, bad_in_a_row: int, display: Display, save, where: Path) -> int:
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
        self.where = "starting"  # what the run is doing, for the messages: "step 7", "saving step 7's checkpoint"

    def __enter__(self) -> "StopRequest":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def request(self, how: str) -> None:
        """Stop after this step as a signal would have it, for a reason of the run's own."""
        self.requested = self.requested or f"{how} during {self.where}"

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self.requested = f"{self.requested}, then {name} during {self.where}"
            raise KeyboardInterrupt
        self.requested = f"{name} during {self.where}"
        print(f"\n{self.requested}: finishing it, then saving a checkpoint (send it again to stop at once)", flush=True)


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
            + (f", --eval-prompts (now {cfg.eval_prompts}: held-out prompts decoded at once)"
               if cfg.eval_every or cfg.eval_before_after else "")
            + (f", or the engine's --gpu-memory-utilization (now {cfg.gpu_memory_utilization})"
               if cfg.generator != "hf" else "") + ". The last completed step is saved; resume with --resume. "
            + (f"`minigrpo plan --model {cfg.model}` says which settings fit, `minigrpo bench model --model "
               f"{cfg.model}` measures them." if cfg.model in PRESETS else ""))
