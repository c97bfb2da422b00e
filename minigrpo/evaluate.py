"""Held-out evaluation: pass@1 with greedy decoding, and the mean reward over n samples; and sampling from
a trained adapter (`sample_texts`, `sample_completions` for episodes), for a look at its words.

During training (`--eval-every N`) and afterwards (`minigrpo eval`), on the task's "test" split, so a
before/after comparison is one command each:

    minigrpo eval --task addition                                  # the base model
    minigrpo eval --task addition --adapter runs/<run>/adapter     # after training
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from minigrpo import settle
from minigrpo.checkpoint import streams_kept
from minigrpo.config import TrainConfig
from minigrpo.generate import Generator, Sampling
from minigrpo.generate.hf import HFGenerator
from minigrpo.scoring import score
from minigrpo.tasks import Task


class Evaluator:
    def __init__(self, cfg: TrainConfig, task: Task, tokenizer, generator: Generator, out_dir: Path | None):
        self.cfg, self.task = cfg, task
        self.tokenizer, self.generator = tokenizer, generator
        self.rows = settle.held_out_rows(cfg, task)
        self.solved = settle.solved_reward(cfg, task)
        if not self.rows:
            raise ValueError(f"task {task.name} has no held-out rows to evaluate on: {settle.HOW_TO_HOLD_OUT}")
        self.out = Path(out_dir) / "eval.jsonl" if out_dir else None

    def __call__(self, step: int | None = None, with_samples: bool = True) -> dict:
        """pass@1 (greedy) and the mean reward of eval_samples samples per prompt; without samples, the mean
        reward is the greedy completions' (fast: the before/after every run gets)."""
        # an evaluation's draws (its samples, the engine's seeds, a reward's own random numbers) go back
        # afterwards, so a run trains the same whether, and how often, it is evaluated
        with streams_kept(self.generator):
            return self._evaluate(step, with_samples)

    def _evaluate(self, step: int | None, with_samples: bool) -> dict:
        start = time.perf_counter()
        greedy, given = self._totals(Sampling(1, self.cfg.max_new_tokens, temperature=0.0))
        n = self.cfg.eval_samples if with_samples else 1
        sampled, answers = self._totals(Sampling(n, self.cfg.max_new_tokens, self.cfg.temperature,
                                                 self.cfg.top_p)) if with_samples else (greedy, [])
        # per-prompt means first, so the standard error is over prompts, the independent unit
        per_prompt = [statistics.fmean(sampled[i * n:(i + 1) * n]) for i in range(len(self.rows))]
        solved = [float(t >= self.solved) for t in greedy]
        result = {
            "step": step, "prompts": len(self.rows), "samples_per_prompt": n if with_samples else 0,
            "pass@1": statistics.fmean(solved), "pass@1/stderr": stderr(solved),
            "reward/mean": statistics.fmean(per_prompt), "reward/stderr": stderr(per_prompt),
            "greedy_reward/mean": statistics.fmean(greedy), "time/eval": time.perf_counter() - start,
        }
        if given:  # a model that gives every prompt one answer scores that answer's share of the rows, not a skill
            result["greedy/top_answer_share"] = top_answer_share(given)
        if with_samples:
            result.update(sampled_metrics(sampled, answers, n, self.solved))
        if self.out:
            with open(self.out, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    def _totals(self, sampling: Sampling) -> tuple[list[float], list]:
        """Each completion's total reward, and its answer where the task can extract one (else [])."""
        from minigrpo.rollout import complete

        out = complete(self.cfg, self.tokenizer, self.generator, self.task, self.rows, sampling)
        totals = score(self.task.rewards, self.task.weights, [c["prompt"] for c in out.columns], out.completions,
                       out.completion_ids, out.columns, timeout=self.cfg.reward_timeout).totals
        return totals, [self.task.answer_of(c) for c in out.completions] if self.task.answer else []


def sampled_metrics(totals: list[float], answers: list, n: int, solved_reward: float) -> dict:
    """Over n samples per prompt (grouped): unbiased pass@k for k = 1, 2, 4, ... and n, and maj@n, the
    share of prompts whose most common answer is a solved one, where the task extracts answers."""
    solved = [[t >= solved_reward for t in totals[i:i + n]] for i in range(0, len(totals), n)]
    ks = sorted({2 ** j for j in range(n.bit_length()) if 2 ** j <= n} | {n})
    out = {}
    for k in ks:
        per_prompt = [pass_at_k(n, sum(s), k) for s in solved]
        out[f"sampled/pass@{k}"] = statistics.fmean(per_prompt)
        out[f"sampled/pass@{k}/stderr"] = stderr(per_prompt)
    if answers:
        votes = [majority_solved(answers[i:i + n], solved[i // n]) for i in range(0, len(totals), n)]
        out[f"sampled/maj@{n}"] = statistics.fmean(votes)
        out[f"sampled/maj@{n}/stderr"] = stderr(votes)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, c of them correct, is
    correct: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021), unbiased, unlike 1 - (1 - c/n)^k.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
    (0.25, 0.5, 0.0, 1.0)
    """
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def top_answer_share(answers: list) -> float:
    """The share of prompts given the most common answer (a prompt given none counts, but not as an answer).

    >>> top_answer_share(["Yes", "Yes", "No", None]), top_answer_share(["3", "5", "8", "13"])
    (0.5, 0.25)
    >>> top_answer_share([None, None])
    0.0
    """
    return max((answers.count(a) for a in answers if a is not None), default=0) / len(answers)


def majority_solved(answers: list, solved: list[bool]) -> float:
    """1.0 when the most common answer (the first to reach that count, answers of None not voting) was
    scored as solved; 0.0 when no sample gave an answer.

    >>> majority_solved(["4", "5", "4", None], [True, False, True, False]), majority_solved([None, None], [False, False])
    (1.0, 0.0)
    """
    given = [a for a in answers if a is not None]
    if not given:
        return 0.0
    top = max(given, key=given.count)
    return float(solved[answers.index(top)])


def stderr(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def sample_texts(prompts: list, adapter=None, model: str | None = None, n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 0.7, seed: int = 0) -> list[str]:
    """Completions (n per prompt, grouped) from a trained adapter, or from the base model without one."""
    from minigrpo.scoring import text_of

    rows = [{"prompt": p} for p in prompts]
    task = Task("prompts", "the given prompts", lambda split, seed: rows, rewards=[])
    completions, _ = sample_completions(task, rows, adapter, model, n, max_new_tokens, temperature, seed)
    return [text_of(c) for c in completions]


def sample_completions(task: Task, rows: list[dict], adapter=None, model: str | None = None, n: int = 1,
                       max_new_tokens: int = 256, temperature: float = 0.7, seed: int = 0,
                       max_turns: int | None = None, max_prompt_tokens: int | None = None,
                       with_ids: bool = False) -> tuple:
    """n completions of each row (grouped) from a trained adapter, or the base model without one: replies,
    or episodes (lists of messages) where the task has tools or an environment, as training makes them.
    Returns them with their columns: what the task's rewards get beside each (the row, its environment);
    `with_ids`, and their token ids."""
    from minigrpo.judge import rubric as judge
    from minigrpo.model import seed_everything
    from minigrpo.trained import load_trained
    from minigrpo.rollout import complete

    seed_everything(seed)
    policy, tokenizer, cfg = load_trained(adapter, model, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                          max_prompt_tokens=max_prompt_tokens)
    cfg = settle.episode_budget(cfg, task)
    generator = HFGenerator(policy, tokenizer)
    judge.attach(judge.base_generate(generator, tokenizer))  # for judge rewards scored on what it samples
    out = complete(cfg, tokenizer, generator, task, rows, Sampling(n, max_new_tokens, temperature))
    return (out.completions, out.columns, out.completion_ids) if with_ids else (out.completions, out.columns)
