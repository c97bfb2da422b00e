"""`minigrpo check-reward`: look at a reward before spending a training run on it.

It runs every reward function on the task's worked examples and on completions sampled from the model,
and reports per function: mean, spread, share of zeros, errors. It warns about what silently wastes a run:
a reward that is constant (no group ever has spread, so nothing is learned), always zero, raises, returns
the wrong number of values, or returns NaN or inf.
"""

from __future__ import annotations

import math
import statistics
import warnings

from rich.console import Console
from rich.table import Table

from minigrpo.scoring import RewardError, reward_name, score
from minigrpo.tasks import Task


def check_rewards(task: Task, rows: list[dict], completions: list, judge_spread: bool = True) -> list[dict]:
    """One report per reward function over (row, completion) pairs: figures and warnings (about spread
    only when `judge_spread`: hand-picked worked examples say nothing about it)."""
    reports = []
    prompts = [str(row["prompt"]) for row in rows]
    ids = [[] for _ in completions]
    for fn in task.rewards:
        name = reward_name(fn)
        report = {"function": name, "mean": math.nan, "std": math.nan, "zeros": math.nan, "errors": 0,
                  "warnings": []}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                scores = score([fn], [1.0], prompts, completions, ids, rows)
            except RewardError as error:
                report["warnings"].append(str(error))
                reports.append(report)
                continue
        values = [v for v in scores.values[name] if v is not None]
        report["errors"] = scores.errors.get(name, 0)
        if values:
            report["mean"] = statistics.fmean(values)
            report["std"] = statistics.pstdev(values)
            report["zeros"] = sum(v == 0 for v in values) / len(values)
        if report["errors"]:
            report["warnings"].append(f"raised on {report['errors']} of {len(completions)} completions")
        if not judge_spread:
            pass
        elif values and all(v == 0 for v in values):
            report["warnings"].append("always zero: no group will have spread, nothing is learned")
        elif len(values) > 1 and report["std"] == 0:
            report["warnings"].append("constant: no group will have spread, nothing is learned")
        reports.append(report)
    return reports


def check_examples(task: Task) -> list[str]:
    """Problems with the task's worked examples: an expected total that the rewards do not give."""
    problems = []
    for i, example in enumerate(task.examples):
        row = {k: v for k, v in example.items() if k not in ("completion", "expected")}
        result = score(task.rewards, task.weights, [str(row["prompt"])], [example["completion"]], [[]], [row],
                       strict=True)
        if "expected" in example and abs(result.totals[0] - example["expected"]) > 1e-6:
            problems.append(f"example {i}: expected {example['expected']}, the rewards give {result.totals[0]}")
    return problems


def print_report(reports: list[dict], title: str, console: Console) -> None:
    table = Table(title=title)
    for column in ("function", "mean", "spread (std)", "share of zeros", "errors"):
        table.add_column(column)
    for r in reports:
        shown = ["n/a" if math.isnan(r[k]) else f"{r[k]:.3f}" for k in ("mean", "std")]  # n/a: all None
        table.add_row(r["function"], *shown, f"{r['zeros']:.0%}" if not math.isnan(r["zeros"]) else "n/a",
                      str(r["errors"]))
    console.print(table)
    for r in reports:
        for warning in r["warnings"]:
            console.print(f"[yellow]warning[/]: {r['function']}: {warning}", highlight=False)


def stand_ins(rows: list[dict], chat: bool = False) -> list[dict]:
    """Junk completions no reward should break on: empty, and the prompt itself, for the first two rows; as
    chat messages where training gives rewards those (chat-format prompts, and episodes)."""
    shape = (lambda text: [{"role": "assistant", "content": text}]) if chat else (lambda text: text)  # noqa: E731
    return [dict(row, completion=shape(text)) for row in rows[:2] for text in ("", str(row["prompt"]))]


def precheck_rewards(task: Task, weights: list[float], rows: list[dict], timeout: float | None = None) -> list[str]:
    """The cheap part of `minigrpo check-reward`, before any model loads: every reward strictly on the
    task's worked examples (they must score as written), and on a few data rows with stand-in completions
    (empty, and the prompt itself), where only a broken contract stops the run (the wrong number of values,
    NaN, a column the data lacks); raising there is what rewards do on junk, and only warned about.
    Returns the warnings."""
    def batch_of(examples):
        rows_only = [{k: v for k, v in r.items() if k not in ("completion", "expected")} for r in examples]
        return ([r["prompt"] for r in examples], [r["completion"] for r in examples], [[] for _ in examples],
                rows_only)

    if task.examples:
        score(task.rewards, weights, *batch_of(task.examples), strict=True, timeout=timeout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chat = bool(task.tools or task.environment) or bool(rows) and isinstance(rows[0]["prompt"], list)
        junk = stand_ins(rows, chat)
        if task.environment:  # rewards may read the episode's environment, as in training: a fresh one, reset
            from minigrpo.episodes import start_environments

            for r in junk:
                r["environments"] = start_environments(task.environment, [{k: v for k, v in r.items()
                                                                           if k != "completion"}], 1)[0][0]
        score(task.rewards, weights, *batch_of(junk), timeout=timeout)
    return [f"on stand-in completions (empty, or the prompt itself): {w.message}" for w in caught
            if "reward function" in str(w.message)]
