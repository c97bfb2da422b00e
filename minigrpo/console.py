"""What a run shows while it trains: one line per step (the reward with its moving mean beside it, since a
step's reward of a few samples is noise), a progress bar with ETA where the output is a terminal, now and then
a sampled completion with its reward parts, and at the end the held-out before and after; and the other
libraries' chatter kept off the console."""

from __future__ import annotations

import logging
import os
import sys
from collections import deque

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

SMOOTHING = 10  # steps in the moving mean of the reward


class Display:
    def __init__(self, total_steps: int, console: Console | None = None):
        # not a terminal (CI, a notebook, `| tee`): plain lines, no progress bar, no wrapping, no colour codes
        self.console = console or Console(soft_wrap=True)
        self.terminal = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=False,
            disable=not self.terminal,
        )
        self.task = self.progress.add_task("training", total=total_steps)
        self.rewards: deque[float] = deque(maxlen=SMOOTHING)
        self.warned: set[str] = set()  # warnings about the run as a whole, said once
        self.flat_steps = 0  # steps in a row, in this process, in which no group's rewards differed
        self.reader_gone = False  # stdout's reader went away: nothing more is printed
        self.on_reader_gone = lambda: None  # what the run does then (train: stop as a signal would)
        self.console.on_broken_pipe = self._reader_went_away

    def __enter__(self) -> "Display":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def print(self, *args, **kwargs) -> None:
        self.progress.console.print(*args, **kwargs)

    def _reader_went_away(self) -> None:
        """`| head -1` ended: what reads the output is gone. Rich's own answer is exit status 1 without a word; a
        run instead says so on stderr and stops as a signal would stop it (`on_reader_gone`)."""
        self.console.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # later writes (and exit's flush) go nowhere
        if not self.reader_gone:
            self.reader_gone = True
            print("minigrpo: the output's reader went away (a `| head` that ended?): finishing this step, then "
                  "stopping as a stopped run does", file=sys.stderr, flush=True)
            self.on_reader_gone()

    def stage(self, step: int) -> None:
        """What is happening now, on the progress bar (the first step on a cpu takes a while)."""
        self.progress.update(self.task, description=f"step {step}: generating, scoring, updating")

    def step(self, m: dict) -> None:
        if m.get("skipped"):
            self.print(f"step {m['step']:>4}  skipped: no group had reward spread after "
                       f"{m['filter/extra_rounds']} extra rounds", highlight=False)
            self.progress.update(self.task, completed=m["step"])
            return
        self.rewards.append(m["reward/mean"])
        smooth = sum(self.rewards) / len(self.rewards)
        line = (f"step {m['step']:>4}  reward {m['reward/mean']:.3f} (mean of last {len(self.rewards)}: {smooth:.3f})  "
                f"spread {m['frac_groups_reward_differs']:.2f}  loss {m['loss']:+.4f}  kl {m['kl']:.4f}  "
                f"len {m['completion_len/mean']:.0f}  {m['time/step']:.1f}s  {m['mem/peak_gb']:.1f}GB")
        self.print(line, highlight=False)
        self.progress.update(self.task, completed=m["step"], description="training")

    def eval(self, r: dict) -> None:
        self.print(f"[bold]held-out[/] step {r['step']}: {describe_eval(r)}", highlight=False)

    def before_after(self, evals: list[dict], source: str | None = None) -> None:
        """The line a first run must not miss: what training did on prompts it never saw (or, with
        `source`, the user's own held-out file, which minigrpo cannot vouch for)."""
        first, last = (evals[0], evals[-1]) if evals else (None, None)
        if not evals or first["step"] != 0 or last["step"] == 0:
            return
        which = f"prompts of {source}" if source else "prompts never trained on"
        self.print(f"[bold green]held-out, {first['prompts']} {which}: pass@1 {first['pass@1']:.3f} "
                   f"-> {last['pass@1']:.3f}, greedy mean reward {first['greedy_reward/mean']:.3f} -> "
                   f"{last['greedy_reward/mean']:.3f} (step 0 -> {last['step']})[/]", highlight=False)

    def gamed(self, finding) -> None:
        """A gaming detector fired (minigrpo/hacking.py): what it saw, and a completion of the first step beside
        one of now."""
        self.print(f"[bold yellow]warning[/]: step {finding.step}: the reward may be gamed ({finding.detector}): "
                   f"{finding.said}", highlight=False)
        for when, s in (("first step", finding.early), (f"step {finding.step}", finding.now)):
            if s:
                text = shown(s["completion"])
                self.print(f"  {when}, reward {s['reward']:.2f}: {text if len(text) < 300 else text[:297] + '...'}",
                           highlight=False, markup=False)

    def sample(self, step: int, sample: dict) -> None:
        # None: the reward does not apply to this sample
        parts = "  ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in sample["reward_parts"].items())
        title = f"step {step} sample: reward {sample['reward']:.2f} ({parts}), advantage {sample['advantage']:+.2f}"
        completion = shown(sample["completion"])
        if not self.terminal:
            self.print(f"{title}\n  prompt: {shown(sample['prompt'])}\n  completion: {completion}", highlight=False,
                       markup=False)
            return
        body = Text()
        body.append("prompt: ", style="bold")
        body.append(f"{shown(sample['prompt'])}\n")
        body.append("completion: ", style="bold")
        body.append(completion)
        self.print(Panel(body, title=title, title_align="left"))


def shown(text_or_messages) -> str:
    """A prompt or completion for the console: text as it is; chat messages (an episode) turn by turn.

    >>> shown([{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "42"}])
    '[assistant] <tool_call>...</tool_call>\\n  [tool] 42'
    """
    if isinstance(text_or_messages, str):
        return text_or_messages
    return "\n  ".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in text_or_messages)


def describe_eval(r: dict) -> str:
    n = r["samples_per_prompt"]
    reward = f"mean reward {r['reward/mean']:.3f} ± {r['reward/stderr']:.3f}" if n else \
        f"greedy mean reward {r['greedy_reward/mean']:.3f}"
    line = (f"pass@1 {r['pass@1']:.3f} ± {r['pass@1/stderr']:.3f}  {reward}  "
            f"({r['prompts']} prompts{f' x {n} samples' if n else ', greedy'})")
    ks = [key.split("@")[1] for key in r if key.startswith("sampled/pass@") and not key.endswith("/stderr")]
    if ks:
        line += "\n  sampled pass@k: " + ", ".join(f"k={k} {r[f'sampled/pass@{k}']:.3f}" for k in ks)
    if f"sampled/maj@{n}" in r:
        line += f"  maj@{n} {r[f'sampled/maj@{n}']:.3f} ± {r[f'sampled/maj@{n}/stderr']:.3f}"
    if "greedy/top_answer_share" in r:  # near the pass@1, the score is one answer's share of the rows
        line += f"\n  greedy: one answer to {r['greedy/top_answer_share']:.0%} of prompts"
    return line


def quiet_libraries() -> None:
    """Other libraries' chatter off the console: transformers' progress bars and advice, the hub's progress
    bars, bitsandbytes' note about an optional kernel package (logged when it is imported). Our own lines
    say what is happening; errors still show."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
