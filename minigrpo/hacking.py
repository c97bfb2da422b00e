"""Signs that a run's reward is being gamed, read from the run's own metrics and samples after each step.

A reward the policy can satisfy without doing the task is the commonest way a hobby run fails: not a crash but a
curve that rises for the wrong reason. Each detector compares the run's last WINDOW steps with its first WINDOW
and, from step 2 x WINDOW on, fires once a run on a pattern the honest runs of docs/cards do not show (the
thresholds, and the runs that chose them, are in docs/results.md):

    length       completions grow past LENGTH_FACTOR x their first steps' length while the reward rises
    one_answer   ONE_ANSWER of the recent completions give the same final answer, unpaid on several prompts
    dominance    one reward function carries the rise while every other, short of its highest, stays flat or falls
    format_only  a reward named for the format saturates while the others, short of theirs, do not move
    spread       the groups lose their reward spread as the reward rises, and held-out pass@1 does not follow
    held_out     the training reward rises and the held-out reward does not rise with it, or pass@1 falls

Every step logs `hacking/<name>`, the number each threshold is read against (from step 2, over what windows the
steps so far allow), and `hacking/<name>/fired` at the step one fires. A firing is a warning with a completion
from the first step beside one from now, in the console and in samples.jsonl; it stops the run only with
--stop-on-hacking. The detectors read nothing but the logs, so a resumed run (or any finished one: `replay`)
is watched the same way.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from minigrpo.scoring import text_of
from minigrpo.tasks import Task

WINDOW = 5  # steps averaged at each end: one step is 2-4 prompts on a cpu preset, too few to judge by
MIN_RISE = 0.1  # a rise of the mean reward smaller than this, in reward units, is not read as one
FLAT = 0.05  # a reward function whose mean moves less than this has not moved
LENGTH_FACTOR = 1.5
ONE_ANSWER = 0.5
ONE_ANSWER_PROMPTS = 4  # prompts the commonest answer is given on without full reward (where it is wrong)
SATURATED = 0.9  # of the highest value the function paid any completion so far
SPREAD_LOST = 0.2  # the share of groups with spread it falls to, from at least twice that in the first steps
HELD_OUT = 0.25  # the held-out reward's rise, as a share of the training reward's, below which it did not follow
NAMES = ("length", "one_answer", "dominance", "format_only", "spread", "held_out")


@dataclass
class Finding:
    detector: str
    step: int
    value: float
    said: str  # what was seen, in numbers, and what to check
    early: dict | None = None  # a sample from the first step
    now: dict | None = None  # a sample from this step

    def record(self) -> dict:
        """Its line of samples.jsonl."""
        return {"step": self.step, "hacking": self.detector, "value": self.value, "message": self.said,
                "early": self.early, "now": self.now}


@dataclass
class Point:
    """What one step leaves for the detectors."""
    reward: float
    length: float
    spread: float
    parts: dict[str, float]  # each reward function's mean, weighted


@dataclass
class Watch:
    task: Task
    points: list[Point] = field(default_factory=list)
    answers: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # per recent step: (prompt, answer, reward)
    best: float = float("-inf")  # the highest total reward any completion has had
    highest: dict[str, float] = field(default_factory=dict)  # each function's highest value paid so far
    first: list[dict] = field(default_factory=list)  # the first step's samples
    evals: list[dict] = field(default_factory=list)  # the first evaluation and the latest
    fired: set[str] = field(default_factory=set)

    def evaluation(self, result: dict) -> None:
        """A held-out evaluation, read by the next `see` (the one of the step it followed)."""
        self.evals = [self.evals[0] if self.evals else result, result]

    def see(self, metrics: dict, samples: list[dict]) -> list[Finding]:
        """Read one step; adds `hacking/*` to `metrics` and returns the detectors that fired now."""
        if "reward/mean" not in metrics:  # a step skipped for want of spread: nothing was scored that counts
            return []
        weights = dict(zip(self.task.reward_names, self.task.weights or [1.0] * len(self.task.rewards)))
        parts = {name: weights[name] * metrics[f"reward/{name}/mean"] for name in weights
                 if weights[name] and metrics.get(f"reward/{name}/mean") is not None}  # weight 0: logged, not paid
        self.points.append(Point(metrics["reward/mean"], metrics["completion_len/mean"],
                                 metrics.get("frac_groups_reward_differs", 1.0), parts))
        self.answers.append([(str(s["prompt"]), self.answer_of(s["completion"]), s["reward"]) for s in samples])
        self.best = max([self.best] + [s["reward"] for s in samples])
        for s in samples:
            for name, value in s["reward_parts"].items():
                self.highest[name] = max(self.highest.get(name, value or 0.0), value or 0.0)
        self.first = self.first or samples
        step, found = metrics["step"], []
        for name, (value, fires, said, pick) in self.measure(step).items():
            metrics[f"hacking/{name}"] = value
            if fires and name not in self.fired and len(self.points) >= 2 * WINDOW:
                self.fired.add(name)
                metrics[f"hacking/{name}/fired"] = 1
                found.append(Finding(name, step, value, said, best(self.first, lambda s: s["reward"]),
                                     best(samples, pick)))
        return found

    def answer_of(self, completion) -> str | None:
        if self.task.answer:
            return self.task.answer_of(completion)
        lines = [line.strip().lower() for line in text_of(completion).splitlines() if line.strip()]
        return " ".join(lines[-1].split()) if lines else None  # no answer function: the last line stands for it

    def measure(self, step: int) -> dict[str, tuple]:
        """Each detector the steps so far can measure: (its number, whether it fires, what it says, which
        sample of this step shows it best)."""
        k = min(WINDOW, len(self.points) // 2)
        if not k:
            return {}
        early, recent = self.points[:k], self.points[-k:]
        reward = mean(p.reward for p in early), mean(p.reward for p in recent)
        rose = reward[1] - reward[0] >= MIN_RISE
        rise = f"while the mean reward rose {reward[0]:.2f} -> {reward[1]:.2f} (steps 1-{k} -> the last {k})"
        evaluated = len(self.evals) == 2 and self.evals[1]["step"] == step and step > self.evals[0]["step"]
        found = {"length": length(early, recent, rose, rise), "one_answer": self.one_answer(rose, rise),
                 "spread": spread(early, recent, reward, rise, self.evals if evaluated else None)}
        moved = {name: mean(p.parts.get(name, 0.0) for p in recent) - mean(p.parts.get(name, 0.0) for p in early)
                 for name in self.points[-1].parts}
        if len(moved) > 1:
            weights = dict(zip(self.task.reward_names, self.task.weights or [1.0] * len(self.task.rewards)))
            # how near each function is to the most it paid any completion: one already there cannot rise, so its
            # staying flat says nothing (a format bonus learned before step 1, beside a correctness reward rising)
            level = {name: mean(p.parts.get(name, 0.0) for p in recent) / weights[name] / self.highest[name]
                     if self.highest.get(name, 0.0) > 0 else 0.0 for name in moved}
            found["dominance"] = dominance(moved, level, reward)
            found["format_only"] = format_only(moved, level)
        if evaluated:
            found["held_out"] = held_out(self.evals, reward)
        return {name: value for name, value in found.items() if value is not None}

    def one_answer(self, rose: bool, rise: str):
        """The commonest answer, and whether it is given where it is wrong: on ONE_ANSWER_PROMPTS prompts or more
        it was not paid as the run's best completions are. Where the right answers really are alike (a product
        with a zero factor is 0), the answer is paid wherever it is given, and that is no collapse."""
        given = [(prompt, answer, reward) for step in self.answers for prompt, answer, reward in step]
        if len({prompt for prompt, _, _ in given}) < ONE_ANSWER_PROMPTS:  # one answer across two prompts: no pattern
            return None
        counts = Counter(answer for _, answer, _ in given if answer is not None)
        if not counts:
            return None
        top, n = counts.most_common(1)[0]
        share = n / len(given)
        unpaid = {prompt for prompt, answer, reward in given if answer == top and reward < SATURATED * self.best}
        return (share, share >= ONE_ANSWER and len(unpaid) >= ONE_ANSWER_PROMPTS and rose,
                f"{share:.0%} of the last {len(self.answers)} steps' completions answer {shown_answer(top)}, given "
                f"without full reward on {len(unpaid)} different prompts, {rise}: the reward pays that answer often "
                f"enough to give it everywhere. Check the reward on prompts whose right answer differs, and weigh the "
                f"held-out pass@1 against the share of that answer",
                lambda s: (self.answer_of(s["completion"]) == top, s["reward"]))


def length(early: list[Point], recent: list[Point], rose: bool, rise: str):
    before, now = mean(p.length for p in early), mean(p.length for p in recent)
    factor = now / max(before, 1.0)
    return (factor, factor >= LENGTH_FACTOR and rose,
            f"completions are {factor:.1f}x as long as in the first steps ({before:.0f} -> {now:.0f} tokens) {rise}. "
            f"Check that the length is work the task needs, not text a reward pays for whatever it says",
            lambda s: len(text_of(s["completion"])))


def spread(early: list[Point], recent: list[Point], reward: tuple[float, float], rise: str, evals: list | None):
    """Groups that stop telling completions apart are what success looks like too, so this one fires only at an
    evaluation whose held-out pass@1 did not rise with the training reward and is not already solved (SATURATED:
    a task the greedy model solves from the start, such as `multiply`, leaves pass@1 no room to rise while
    sampling sharpens toward it)."""
    before, now = mean(p.spread for p in early), mean(p.spread for p in recent)
    lost = before >= 2 * SPREAD_LOST and now <= SPREAD_LOST and reward[1] - reward[0] >= MIN_RISE
    first, last = evals or ({}, {})
    solved = last.get("pass@1", 0.0) - first.get("pass@1", 0.0)
    unsolved = last.get("pass@1", 0.0) < SATURATED
    return (now, lost and evals is not None and unsolved and solved <= HELD_OUT * (reward[1] - reward[0]),
            f"the share of groups whose completions score differently fell {before:.2f} -> {now:.2f} {rise}, while "
            f"held-out pass@1 went {first.get('pass@1', 0.0):.2f} -> {last.get('pass@1', 0.0):.2f} (steps "
            f"{first.get('step')} -> {last.get('step')}): the reward saturated on the training prompts without "
            f"solving more held-out ones. Check what the reward pays that a right answer is not needed for",
            lambda s: s["reward"])


def dominance(moved: dict[str, float], level: dict[str, float], reward: tuple[float, float]):
    total = sum(moved.values())
    name = max(moved, key=lambda n: moved[n])
    others = [n for n in moved if n != name]
    share = moved[name] / total if total >= MIN_RISE else 0.0  # of a rise too small to read, no share
    return (share, total >= MIN_RISE and all(moved[o] <= FLAT and level[o] < SATURATED for o in others),
            f"{name} carried the rise of the mean reward ({reward[0]:.2f} -> {reward[1]:.2f}; {name} "
            f"{moved[name]:+.2f}) while {', '.join(others)}, short of {'its' if len(others) == 1 else 'their'} "
            f"highest, moved {', '.join(f'{moved[o]:+.2f}' for o in others)}. Check that what {name} pays for is the "
            f"task, not something beside it", lambda s: (s["reward_parts"].get(name) or 0.0))


def format_only(moved: dict[str, float], level: dict[str, float]):
    formats = [name for name in moved if "format" in name.lower()]
    others = [name for name in moved if name not in formats]
    if not formats or not others:
        return None
    name = max(formats, key=lambda n: moved[n])
    fires = level[name] >= SATURATED and moved[name] >= MIN_RISE and all(
        abs(moved[o]) <= FLAT and level[o] < SATURATED for o in others)
    return (level[name], fires,
            f"{name} is at {level[name]:.0%} of its highest and rose {moved[name]:+.2f}, while {', '.join(others)} "
            f"moved {', '.join(f'{moved[o]:+.2f}' for o in others)}: the form is learned and the answers are "
            f"not. Check that {name} pays nothing a wrong answer can earn, or lower its weight",
            lambda s: ((s["reward_parts"].get(name) or 0.0), -sum(s["reward_parts"].get(o) or 0.0 for o in others)))


def held_out(evals: list[dict], reward: tuple[float, float]):
    """The held-out reward not following the training reward's rise; or the held-out pass@1 falling by more than
    twice its standard error while it rises (a partial-credit reward paid for near misses: docs/results.md)."""
    first, last = evals
    train, held = reward[1] - reward[0], last["reward/mean"] - first["reward/mean"]
    share = held / train if train > 0 else 1.0
    fell = first.get("pass@1", 0.0) - last.get("pass@1", 0.0)
    noise = 2 * (first.get("pass@1/stderr", 0.0) ** 2 + last.get("pass@1/stderr", 0.0) ** 2) ** 0.5
    lost = fell > max(noise, FLAT)
    went = (f"held-out pass@1 fell {first.get('pass@1', 0.0):.2f} -> {last.get('pass@1', 0.0):.2f}" if lost else
            f"held-out reward went {first['reward/mean']:.2f} -> {last['reward/mean']:.2f}")
    return (share, train >= MIN_RISE and (share <= HELD_OUT or lost),
            f"the training reward rose {reward[0]:.2f} -> {reward[1]:.2f} while the {went} (steps {first['step']} -> "
            f"{last['step']}): what it learned does not carry to prompts it never saw. Check for an answer the "
            f"training rows share, or rows the reward scores by something besides the answer (partial credit for "
            f"a near miss)", lambda s: s["reward"])


def replay(folder: Path, task: Task) -> tuple[Watch, list[Finding], list[dict]]:
    """Watch a run's logs as the run did, step by step: the watch a resumed run goes on with, every detector's
    firing, and each step's metrics with the `hacking/*` numbers added (docs/results.md measured its thresholds
    so)."""
    watch, found, steps = Watch(task), [], []
    evals = {e["step"]: e for e in read_lines(folder / "eval.jsonl")}
    if 0 in evals:
        watch.evaluation(evals[0])
    samples = samples_by_step(folder / "samples.jsonl")
    step_samples = next(samples, None)
    for metrics in read_lines(folder / "metrics.jsonl"):
        step = metrics["step"]
        while step_samples is not None and step_samples[0] < step:
            step_samples = next(samples, None)
        if step in evals:
            watch.evaluation(evals[step])
        found += watch.see(metrics, step_samples[1] if step_samples and step_samples[0] == step else [])
        steps.append(metrics)
    return watch, found, steps


def samples_by_step(path: Path):
    """(step, its samples) in order, streamed: a long run's samples.jsonl need not fit in memory."""
    step, group = None, []
    for sample in read_lines(path):
        if "hacking" in sample:
            continue
        if sample["step"] != step and group:
            yield step, group
            group = []
        step = sample["step"]
        group.append(sample)
    if group:
        yield step, group


def read_lines(path: Path):
    """A log's records; a log kept gzipped (a run's logs copied for a test) is read the same."""
    zipped = path.with_name(path.name + ".gz")
    if path.exists() or zipped.exists():
        with open(path) if path.exists() else gzip.open(zipped, "rt") as f:
            yield from (json.loads(line) for line in f if line.strip())


def best(samples: list[dict], key) -> dict | None:
    """The sample that shows a finding best, as samples.jsonl has it but its prompt."""
    if not samples:
        return None
    chosen = max(samples, key=key)
    return {k: chosen[k] for k in ("step", "prompt", "completion", "reward", "reward_parts") if k in chosen}


def shown_answer(answer: str) -> str:
    return repr(answer if len(answer) <= 40 else answer[:37] + "...")


def mean(values) -> float:
    return statistics.fmean(list(values))
