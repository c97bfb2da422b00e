"""Proof that it learns: held-out reward before and after a short CPU run of the offline tiny model.

The run behind the README's curve, evaluated only before and after to save four minutes:
    minigrpo train --steps 30 --eval-every 15 --eval-prompts 64 --eval-samples 4
"""

import json
import math

import pytest

from minigrpo import TrainConfig, train


@pytest.mark.slow
def test_grpo_lifts_held_out_reward_on_cpu(tmp_path):
    run = train(TrainConfig(model="smollm2-135m", task="addition", steps=30, eval_every=30, eval_prompts=64,
                            eval_samples=4, sample_every=0, save_every=0, seed=0, output_dir=str(tmp_path / "run")))
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    before, after = evals[0], evals[-1]
    assert (before["step"], after["step"]) == (0, 30) and before["prompts"] >= 64 and before["samples_per_prompt"] >= 4
    margin = after["reward/mean"] - before["reward/mean"]
    noise = math.hypot(before["reward/stderr"], after["reward/stderr"])
    print(f"held-out mean reward: {before['reward/mean']:.3f} ± {before['reward/stderr']:.3f} before, "
          f"{after['reward/mean']:.3f} ± {after['reward/stderr']:.3f} after 30 steps (+{margin:.3f}, {margin / noise:.1f} "
          f"standard errors)")
    assert margin >= 0.20, f"the held-out reward rose by {margin:.3f}, less than 0.20"
    assert margin > 4 * noise, "the rise is not well outside the noise"
