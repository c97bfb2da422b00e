"""What a run shows while it trains: a progress bar with ETA, one line per step, and now and then a
sampled completion with its reward parts, because the model's words say more than its numbers."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text


class Display:
    def __init__(self, total_steps: int, console: Console | None = None):
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps)

    def __enter__(self) -> "Display":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def print(self, *args, **kwargs) -> None:
        self.progress.console.print(*args, **kwargs)

    def step(self, m: dict) -> None:
        if m.get("skipped"):
            self.print(f"step {m['step']:>4}  skipped: no group had reward spread after "
                       f"{m['filter/extra_rounds']} extra rounds", highlight=False)
            self.progress.update(self.task, completed=m["step"])
            return
        line = (f"step {m['step']:>4}  reward {m['reward/mean']:.3f} ± {m['reward/std']:.3f}  "
                f"spread {m['frac_groups_reward_differs']:.2f}  loss {m['loss']:+.4f}  kl {m['kl']:.4f}  "
                f"len {m['completion_len/mean']:.0f}  {m['time/step']:.1f}s  {m['mem/peak_gb']:.1f}GB")
        self.print(line, highlight=False)
        self.progress.update(self.task, completed=m["step"])

    def eval(self, r: dict) -> None:
        self.print(f"[bold]eval[/] step {r['step']}: pass@1 {r['pass@1']:.3f} ± {r['pass@1/stderr']:.3f}  "
                   f"mean reward {r['reward/mean']:.3f} ± {r['reward/stderr']:.3f} "
                   f"({r['prompts']} held-out prompts x {r['samples_per_prompt']} samples)", highlight=False)

    def sample(self, step: int, sample: dict) -> None:
        # None: the reward does not apply to this sample
        parts = "  ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in sample["reward_parts"].items())
        body = Text()
        body.append("prompt: ", style="bold")
        body.append(sample["prompt"] + "\n")
        body.append("completion: ", style="bold")
        body.append(sample["completion"])
        title = f"step {step} sample: reward {sample['reward']:.2f} ({parts}), advantage {sample['advantage']:+.2f}"
        self.print(Panel(body, title=title, title_align="left"))
