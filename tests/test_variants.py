"""The algorithm surface end to end on the tiny model: loss presets, reuse, filtering, curriculum, eval."""

import json
import math

import pytest
from typer.testing import CliRunner

from minigrpo import TrainConfig, train
from minigrpo.cli.app import app
from minigrpo.state import PromptPool

SMALL = dict(steps=2, num_generations=4, prompts_per_step=2, max_new_tokens=12, sample_every=0, seed=1,
             eval_before_after=False)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("preset, extra", [
    ("grpo", {}),
    ("dr_grpo", {"mask_truncated": True}),
    ("dapo", {"epsilon_high": 0.28, "num_iterations": 2}),
    ("bnpo", {"beta": 0.04}),
    ("gspo", {"num_iterations": 2}),
    ("cispo", {"top_entropy_quantile": 0.2}),
])
def test_each_loss_preset_trains(tmp_path, preset, extra):
    run = train(TrainConfig(loss=preset, output_dir=str(tmp_path / "run"), **SMALL, **extra))
    config = json.loads((run / "config.json").read_text())
    assert (config["scale_rewards"], config["loss_aggregation"]) == {
        "grpo": ("group", "sequence"), "dr_grpo": ("none", "constant"),
        "dapo": ("group", "token"), "bnpo": ("batch", "token"), "gspo": ("group", "sequence"),
        "cispo": ("group", "token")}[preset]
    for m in read(run / "metrics.jsonl"):
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
        if not extra.get("mask_truncated") or m["truncated_frac"] < 1:  # else every token is masked out
            assert m["entropy"] > 0
    assert (run / "adapter" / "adapter_model.safetensors").exists()


def test_reusing_a_rollout_engages_the_ratio(tmp_path):
    # a reward with spread in every group (the share of the letter e), so every step updates the policy
    (tmp_path / "reward.py").write_text("def letter_e(prompts, completions, **kw):\n"
                                        "    return [c.count('e') / (len(c) + 1) for c in completions]\n")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n"
                                                 for w in ["hello", "tree", "eleven", "yes"] * 5))
    run = train(TrainConfig(task=str(tmp_path / "data.jsonl"), rewards=[f"{tmp_path / 'reward.py'}:letter_e"],
                            num_iterations=3, learning_rate=5e-3, output_dir=str(tmp_path / "run"), **SMALL))
    metrics = read(run / "metrics.jsonl")
    assert all(m["frac_groups_reward_differs"] == 1.0 for m in metrics)
    # the last of three passes sees a policy two optimizer steps away from the sampling one
    assert any(abs(m["ratio/mean"] - 1) > 1e-4 for m in metrics)


def test_filter_groups_trains_only_groups_with_spread(tmp_path):
    run = train(TrainConfig(filter_groups=True, max_filter_rounds=4, output_dir=str(tmp_path / "run"),
                            **dict(SMALL, steps=3)))
    metrics = read(run / "metrics.jsonl")
    assert all("filter/extra_rounds" in m and "frac_groups_reward_differs" in m for m in metrics)
    samples = read(run / "samples.jsonl")
    groups = {}
    for s in samples:
        groups.setdefault((s["step"], s["prompt"]), []).append(s["reward"])
    assert groups, "some step trained"
    assert all(max(r) > min(r) for r in groups.values()), "every trained group had reward spread"


def test_curriculum_retires_solved_prompts_and_visits_unsolved_ones_less():
    rows = [{"prompt": str(i)} for i in range(4)]
    pool = PromptPool(rows, seed=0, retire_after=2)
    for _ in range(2):
        pool.record([rows[0]], [1.0, 1.0], 2, solved_reward=1.0)  # always solved
        pool.record([rows[1]], [0.0, 0.0], 2, solved_reward=1.0)  # never solved
    assert pool.metrics() == {"pool/size": 3, "pool/retired": 1}
    drawn = [r["prompt"] for r in pool.draw(300)]
    assert "0" not in drawn
    assert drawn.count("1") < drawn.count("2") / 2


def test_eval_before_and_after(tmp_path):
    run = train(TrainConfig(output_dir=str(tmp_path / "run"), eval_every=2, eval_prompts=4, eval_samples=2, **SMALL))
    evals = read(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert {"sampled/pass@1", "sampled/pass@2", "sampled/maj@2"} <= set(evals[0])
    args = ["eval", "--task", "addition", "--prompts", "4", "--samples", "3", "--max-new-tokens", "12"]
    base = CliRunner().invoke(app, args + ["--out", str(tmp_path / "evals")])
    after = CliRunner().invoke(app, args + ["--adapter", str(run / "adapter")])
    assert base.exit_code == 0 and after.exit_code == 0, base.output + after.output
    assert "base model smollm2-135m on addition: pass@1" in base.output
    assert "adapter" in after.output and "pass@1" in after.output and "sampled pass@k: k=1" in after.output
    assert len(read(run / "eval.jsonl")) == 3 and len(read(tmp_path / "evals" / "eval.jsonl")) == 1
    (result,) = read(tmp_path / "evals" / "eval.jsonl")
    passes = [result[f"sampled/pass@{k}"] for k in (1, 2, 3)]  # powers of two up to n, and n itself
    assert passes == sorted(passes) and "sampled/pass@4" not in result and "sampled/maj@3" in result
    # addition extracts answers: the share of the 4 prompts given the commonest greedy one, said on the line too
    assert result["greedy/top_answer_share"] in (0, 0.25, 0.5, 0.75, 1.0)
    assert f"greedy: one answer to {result['greedy/top_answer_share']:.0%} of prompts" in base.output
    from minigrpo.plot import plot_run

    assert plot_run(run).exists()  # the held-out panel with the sampled pass@k and maj@k


def test_pass_at_k_and_majority_against_enumeration():
    """The unbiased estimator equals the share of all k-subsets of the n samples that hold a solved one."""
    import itertools

    from minigrpo.evaluate import sampled_metrics

    solved = [[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]
    answers = [["7", "3", "3", "7", None], [None] * 5, ["5"] * 5, ["1", "2", "1", "1", "9"]]
    totals = [float(x) for row in solved for x in row]
    got = sampled_metrics(totals, [a for row in answers for a in row], 5, solved_reward=1.0)
    assert sorted(k for k in got if not k.endswith("stderr")) == [
        "sampled/maj@5", "sampled/pass@1", "sampled/pass@2", "sampled/pass@4", "sampled/pass@5"]
    for k in (1, 2, 4, 5):
        per_prompt = [sum(any(row[i] for i in subset) for subset in itertools.combinations(range(5), k))
                      / math.comb(5, k) for row in solved]
        assert got[f"sampled/pass@{k}"] == pytest.approx(sum(per_prompt) / 4)
    # majorities: "7" and "3" tie at two, the first to appear wins (solved); none; "5" (solved); "1" (not)
    assert got["sampled/maj@5"] == pytest.approx(2 / 4)
