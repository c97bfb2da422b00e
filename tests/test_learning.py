"""Proof that it learns: held-out reward before and after a short CPU run of the offline tiny model, on
single replies (addition) and on multi-turn episodes (the guess game).

The runs behind the curves of docs/results.md (the first evaluated only before and after here, to save four minutes):
    minigrpo train --steps 30 --eval-every 15 --eval-prompts 64 --eval-samples 4
    minigrpo train --task guess --max-new-tokens 16 --steps 30 --eval-every 30 --eval-prompts 64 --eval-samples 4 \
        --prompts-per-step 2 --num-generations 8 --learning-rate 2e-4
"""

import json
import math

import pytest

from minigrpo import TrainConfig, train


@pytest.mark.slow
def test_grpo_lifts_held_out_reward_on_cpu(tmp_path):
    run = train(TrainConfig(model="smollm2-135m", task="addition", steps=30, eval_every=30, eval_prompts=64,
                            eval_samples=4, sample_every=0, save_every=0, seed=0, output_dir=str(tmp_path / "run")))
    # +0.61 to +0.75 in five seeds at the preset's rate on Zen 4 (+0.73 at seed 0), but seed 0 on another CPU of this
    # kind rose +0.40: one seed cannot tell the preset's rate from half it (+0.25 to +0.49), only that it learns
    assert_rise(run, at_least=0.30)


@pytest.mark.slow
def test_grpo_lifts_held_out_episode_reward_on_cpu(tmp_path):
    """Episodes of up to four turns with the environment answering each; the reward is 1 for finding the
    number, else up to 0.5 for how close the last guess came. The two evaluations play 64 games each, greedy and 4
    samples: 578 s in all on 2 cores of an AMD EPYC with AVX512-BF16, half of it evaluating (at 2 samples the rise,
    on another random path, stood 4.7 standard errors clear, too near the bound below to keep)."""
    # the settings this was measured at (the preset's before it went to 4 prompts x 4 at 4e-4 on addition)
    run = train(TrainConfig(model="smollm2-135m", task="guess", max_new_tokens=16, steps=30, eval_every=30,
                            eval_prompts=64, eval_samples=4, sample_every=0, save_every=0, seed=0,
                            prompts_per_step=2, num_generations=8, learning_rate=2e-4,
                            output_dir=str(tmp_path / "run")))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s["episode/turns"] for s in steps) > 1  # the game went past its first guess
    assert_rise(run, at_least=0.10)  # +0.38 (0.306 -> 0.686, 8.8 standard errors) on 2 cores with AVX512-BF16
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    # the greedy player follows the hints: 0.078 -> 0.656 here, +0.66 to +0.73 in three seeds of docs/cards
    assert evals[-1]["pass@1"] - evals[0]["pass@1"] >= 0.25


def assert_rise(run, at_least: float) -> None:
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    before, after = evals[0], evals[-1]
    assert (before["step"], after["step"]) == (0, 30) and before["prompts"] >= 64 and before["samples_per_prompt"] >= 4
    margin = after["reward/mean"] - before["reward/mean"]
    noise = math.hypot(before["reward/stderr"], after["reward/stderr"])
    print(f"held-out mean reward: {before['reward/mean']:.3f} ± {before['reward/stderr']:.3f} before, "
          f"{after['reward/mean']:.3f} ± {after['reward/stderr']:.3f} after 30 steps (+{margin:.3f}, {margin / noise:.1f} "
          f"standard errors)")
    assert margin >= at_least, f"the held-out reward rose by {margin:.3f}, less than {at_least}"
    assert margin > 4 * noise, "the rise is not well outside the noise"
