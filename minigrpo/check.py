"""`minigrpo check-reward`: look at a reward before spending a training run on it.

It runs every reward function on the task's worked examples and on completions sampled from the model,
and reports per function: mean, spread, share of zeros, errors. It warns about what silently wastes a run:
a reward that is constant (no group ever has spread, so nothing is learned), always zero, raises, returns
the wrong number of values, or returns NaN or inf.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings

from rich.console import Console
from rich.table import Table

from minigrpo.scoring import RewardError, reward_name, score, text_of
from minigrpo.tasks import Task


def check_task(t: Task, rows: list[dict], console: Console, model: str | None = None, samples: int | None = None,
               max_new_tokens: int | None = None, seed: int = 0, max_turns: int | None = None,
               max_prompt_tokens: int | None = None, tokenizer_of: str | None = None) -> None:
    """`minigrpo check-reward`: the worked examples, stand-in completions, and with a model, G completions
    (or episodes) sampled for each row, with the share of groups GRPO could learn from."""
    from rich.markup import escape

    from minigrpo.config import TrainConfig
    from minigrpo.console import shown
    from minigrpo.evaluate import sample_completions

    preflight(t.rewards)
    judged, t = t, without_judges(t)
    if len(t.rewards) < len(judged.rewards):
        console.print("[yellow]note[/]: judge rewards are checked on sampled completions only (they need the "
                      "model, and grade worked examples differently from run to run)", highlight=False)
    if t.rewards:
        _check_without_model(t, rows, console, stand_in_tokenizer(tokenizer_of or model))
    if model is None:
        return
    t = judged
    preset = TrainConfig(model=model)
    samples = samples or preset.num_generations
    completions, columns, ids = sample_completions(t, rows, model=model, n=samples, temperature=1.0, seed=seed,
                                                   max_new_tokens=max_new_tokens or preset.max_new_tokens,
                                                   max_turns=max_turns, max_prompt_tokens=max_prompt_tokens,
                                                   with_ids=True)
    kind = "episodes" if t.tools or t.environment else "completions"
    print_report(check_rewards(t, columns, completions, completion_ids=ids),
                 f"{t.name}: {len(completions)} {kind} sampled from {model}", console)
    share, warning = learnable_share(t, columns, completions, samples, ids)
    console.print(f"groups with reward spread (the only ones GRPO learns from): {share:.0%} of {len(rows)} prompts "
                  f"x G={samples}", highlight=False)
    if warning:
        console.print(f"[yellow]warning[/]: {warning}", highlight=False)
    first = completions[0]
    console.print(f"[bold]a sample[/]: {escape(repr(first) if isinstance(first, str) else shown(first))}",
                  highlight=False)


def _check_without_model(t: Task, rows: list[dict], console: Console, tokenizer=None) -> None:
    for problem in check_examples(t):
        console.print(f"[red]worked example[/]: {problem}", highlight=False)
    if t.examples:
        example_rows = [{k: v for k, v in e.items() if k not in ("completion", "expected")} for e in t.examples]
        print_report(check_rewards(t, example_rows, [e["completion"] for e in t.examples], judge_spread=False),
                     f"{t.name}: worked examples", console)
    else:
        console.print(f"[yellow]note[/]: task {t.name} has no worked examples, so no score is checked against an "
                      f"expected one; add some (Task(examples=[...])) to check the rewards' values", highlight=False)
    # what the run's precheck does: junk completions must not break the contract
    _, completions, ids, rows = as_batch(stand_ins(t, rows, tokenizer))
    print_report(check_rewards(t, rows, completions, judge_spread=False, completion_ids=ids),
                 f"{t.name}: stand-in completions (empty, and the prompt itself)", console)
    from minigrpo.gaming import gamed

    found = gamed(t)
    for way in found:
        console.print(f"[yellow]gameable[/]: {way}", highlight=False)
    if t.examples and not found and not (t.tools or t.environment):
        console.print("gaming probes (nothing, another prompt's answer, the format alone, the prompt said back, the "
                      "answer buried in filler): none is paid as much as a right worked example", highlight=False)


def check_rewards(task: Task, rows: list[dict], completions: list, judge_spread: bool = True,
                  completion_ids: list[list[int]] | None = None) -> list[dict]:
    """One report per reward function over (row, completion) pairs: figures and warnings (about spread
    only when `judge_spread`: hand-picked worked examples say nothing about it). Prompts go as the data has
    them (chat messages stay messages), as in training."""
    reports = []
    prompts = [row["prompt"] for row in rows]
    ids = completion_ids or [[] for _ in completions]
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
        if not values and not report["errors"]:
            report["warnings"].append("returned None for every completion: it scores none of them")
        elif not judge_spread:
            pass
        elif values and all(v == 0 for v in values):
            report["warnings"].append("always zero: no group will have spread, nothing is learned")
        elif len(values) > 1 and report["std"] == 0:
            report["warnings"].append("constant: no group will have spread, nothing is learned")
        reports.append(report)
    return reports


def preflight(rewards: list) -> None:
    """A reward that depends on something outside (a judge's server) checks it before anything trains."""
    for fn in rewards:
        if callable(getattr(fn, "preflight", None)):
            fn.preflight()


def stand_in_tokenizer(model: str | None):
    """The model's tokenizer, for stand-in completions' ids (token-based rewards read them); None where it
    cannot be had without a download."""
    if model is None:
        return None
    try:
        from minigrpo.config import TrainConfig
        from minigrpo.model import load_tokenizer
        from minigrpo.weights import resolve_weights

        return load_tokenizer(resolve_weights(TrainConfig(model=model).hub_id))
    except Exception:  # offline and not cached: the stand-ins go without ids, as before
        return None


def without_judges(task: Task) -> Task:
    """The task with only the rewards that can run before a model loads: a judge (`precheck = False`)
    needs the model, and grades worked examples differently from run to run."""
    weights = task.weights or [1.0] * len(task.rewards)
    kept = [(fn, w) for fn, w in zip(task.rewards, weights) if getattr(fn, "precheck", True)]
    return dataclasses.replace(task, rewards=[fn for fn, _ in kept], weights=[w for _, w in kept])


def learnable_share(task: Task, rows: list[dict], completions: list, group_size: int,
                    completion_ids: list[list[int]] | None = None) -> tuple[float, str | None]:
    """The share of prompt groups (group_size completions each, in order) whose total rewards differ: in
    GRPO only those carry a gradient. Returns it, and a warning when it is low."""
    import torch

    from minigrpo.loss import groups_with_spread

    totals = score(task.rewards, task.weights or [1.0] * len(task.rewards), [r["prompt"] for r in rows],
                   completions, completion_ids or [[] for _ in completions], rows).totals
    share = groups_with_spread(torch.tensor(totals), group_size).float().mean().item()
    if share >= 0.25:
        return share, None
    why = (f"every completion scored {totals[0]:g}" if len(set(totals)) == 1
           else "within most groups every completion scored the same")
    return share, (f"only {share:.0%} of the prompt groups have reward spread, so most steps teach little ({why}: "
                   f"the task is too hard or too easy for this model, or the reward too coarse; partial credit, "
                   f"a larger G or another model give GRPO more to learn from)")


def check_examples(task: Task) -> list[str]:
    """Problems with the task's worked examples: an expected total that the rewards do not give."""
    problems = []
    for i, example in enumerate(task.examples):
        row = {k: v for k, v in example.items() if k not in ("completion", "expected")}
        result = score(task.rewards, task.weights, [row["prompt"]], [example["completion"]], [[]], [row],
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


def stand_ins(task: Task, rows: list[dict], tokenizer=None) -> list[dict]:
    """Junk completions no reward should break on: empty, and the prompt itself, for the first two rows, shaped
    as training gives them: chat messages for chat-format prompts and episodes, each episode's environment
    made and reset as a run makes it, and `completion_ids` from the model's tokenizer where there is one."""
    chat = bool(task.tools or task.environment) or bool(rows) and isinstance(rows[0]["prompt"], list)
    shape = (lambda text: [{"role": "assistant", "content": text}]) if chat else (lambda text: text)  # noqa: E731
    junk = []
    for row in rows[:2]:
        for text in ("", str(text_of(row["prompt"]))):
            ids = tokenizer(text, add_special_tokens=False).input_ids if tokenizer is not None else []
            junk.append(dict(row, completion=shape(text), completion_ids=ids))
    if task.environment:  # rewards may read the episode's environment, as in training: a fresh one, reset
        from minigrpo.episodes import start_environments

        for r in junk:
            row = {k: v for k, v in r.items() if k not in ("completion", "completion_ids")}
            r["environments"] = start_environments(task.environment, [row], 1, task.environment_prompts)[0][0]
    return junk


def as_batch(examples: list[dict]) -> tuple[list, list, list, list]:
    """(prompts, completions, completion_ids, rows) of rows that carry their completion."""
    rows = [{k: v for k, v in r.items() if k not in ("completion", "expected", "completion_ids")} for r in examples]
    return ([r["prompt"] for r in examples], [r["completion"] for r in examples],
            [r.get("completion_ids", []) for r in examples], rows)


def precheck_rewards(task: Task, rows: list[dict], timeout: float | None = None) -> list[str]:
    """The cheap part of `minigrpo check-reward`, before any model loads: every reward strictly on the
    task's worked examples (they must score as written), and on a few data rows with stand-in completions
    (empty, and the prompt itself), where only a broken contract stops the run (the wrong number of values,
    NaN, a column the data lacks); raising there is what rewards do on junk, and only warned about.
    Returns the warnings."""
    preflight(task.rewards)
    task = without_judges(task)
    if not task.rewards:
        return []
    if task.examples:
        score(task.rewards, task.weights, *as_batch(task.examples), strict=True, timeout=timeout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        score(task.rewards, task.weights, *as_batch(stand_ins(task, rows)), timeout=timeout)
    return [f"on stand-in completions (empty, or the prompt itself): {w.message}" for w in caught
            if "reward function" in str(w.message)]
