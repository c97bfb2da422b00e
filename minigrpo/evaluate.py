"""Held-out evaluation: pass@1 with greedy decoding, and the mean reward over n samples; and sampling from
a trained adapter (`sample_texts`), for a look at its words.

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

from minigrpo.config import TrainConfig
from minigrpo.generation import Generator, HFGenerator, Sampling
from minigrpo.scoring import score
from minigrpo.tasks import Task


class Evaluator:
    def __init__(self, cfg: TrainConfig, task: Task, weights: list[float], tokenizer, generator: Generator,
                 out_dir: Path | None):
        self.cfg, self.task, self.weights = cfg, task, weights
        self.tokenizer, self.generator = tokenizer, generator
        self.rows = task.make_data("test", cfg.seed)[:cfg.eval_prompts]
        if not self.rows:
            raise ValueError(f"task {task.name} has no held-out rows to evaluate on")
        self.out = Path(out_dir) / "eval.jsonl" if out_dir else None

    def __call__(self, step: int | None = None, with_samples: bool = True) -> dict:
        """pass@1 (greedy) and the mean reward of eval_samples samples per prompt; without samples, the mean
        reward is the greedy completions' (fast: the before/after every run gets)."""
        start = time.perf_counter()
        greedy = self._totals(Sampling(1, self.cfg.max_new_tokens, temperature=0.0))
        n = self.cfg.eval_samples if with_samples else 1
        sampled = self._totals(Sampling(n, self.cfg.max_new_tokens, self.cfg.temperature,
                                        self.cfg.top_p)) if with_samples else greedy
        # per-prompt means first, so the standard error is over prompts, the independent unit
        per_prompt = [statistics.fmean(sampled[i * n:(i + 1) * n]) for i in range(len(self.rows))]
        solved = [float(t >= self.cfg.solved_reward) for t in greedy]
        result = {
            "step": step, "prompts": len(self.rows), "samples_per_prompt": n if with_samples else 0,
            "pass@1": statistics.fmean(solved), "pass@1/stderr": stderr(solved),
            "reward/mean": statistics.fmean(per_prompt), "reward/stderr": stderr(per_prompt),
            "greedy_reward/mean": statistics.fmean(greedy), "time/eval": time.perf_counter() - start,
        }
        if self.out:
            with open(self.out, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    def _totals(self, sampling: Sampling) -> list[float]:
        from minigrpo.rollout import complete

        out = complete(self.cfg, self.tokenizer, self.generator, self.task, self.rows, sampling)
        return score(self.task.rewards, self.weights, [c["prompt"] for c in out.columns], out.completions,
                     out.completion_ids, out.columns, timeout=self.cfg.reward_timeout).totals


def stderr(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def sample_texts(prompts: list, adapter=None, model: str | None = None, n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 0.7, seed: int = 0) -> list[str]:
    """Completions (n per prompt, grouped) from a trained adapter, or from the base model without one."""
    from minigrpo.model import load_trained, seed_everything
    from minigrpo.rollout import render_prompt

    seed_everything(seed)
    policy, tokenizer, _ = load_trained(adapter, model)
    ids = [tokenizer(render_prompt(tokenizer, p), add_special_tokens=False).input_ids for p in prompts]
    out = HFGenerator(policy, tokenizer).generate(ids, Sampling(n, max_new_tokens, temperature))
    return tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
