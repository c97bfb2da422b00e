import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from minigrpo.cli.app import app

STEP_KEYS = {
    "step", "reward/mean", "reward/std", "reward/addition_reward/mean", "frac_groups_reward_differs", "kl",
    "clip_frac", "loss", "completion_len/mean", "completion_len/max", "truncated_frac", "lr", "grad_norm",
    "time/generate", "time/train", "time/step", "tokens_per_s", "mem/peak_gb",
}


def test_train_two_steps_end_to_end(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--model", "smollm2-135m", "--task", "addition", "--steps", "2", "--out", str(out),
        "--num-generations", "4", "--prompts-per-step", "2", "--max-new-tokens", "24", "--micro-batch-size", "3",
        "--beta", "0.04", "--seed", "1", "--sample-every", "1", "--4bit",
    ])
    assert result.exit_code == 0, result.output
    assert "step    2" in result.output and "sample" in result.output and "(mean of last 2:" in result.output
    # the before/after every run ends with, on held-out prompts, greedy (fast), and no terminal codes here
    assert "held-out, 64 prompts never trained on: pass@1" in result.output and "(step 0 -> 2)" in result.output
    assert "\x1b" not in result.output and "\r" not in result.output
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["samples_per_prompt"]) for e in evals] == [(0, 0), (2, 0)]

    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 2 and config["num_generations"] == 4 and config["load_in_4bit"] is True

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # watched by the gaming detectors from step 2, too soon for one to fire
    assert "hacking/length" in metrics[1] and not any(k.endswith("/fired") for k in metrics[1])
    for m in metrics:
        assert STEP_KEYS <= m.keys(), STEP_KEYS - m.keys()
        assert 0 <= m["frac_groups_reward_differs"] <= 1 and m["completion_len/max"] <= 24
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4
    assert {"prompt", "completion", "reward", "reward_parts", "advantage"} <= samples[0].keys()

    # the adapter reloads, and training moved it away from its zero start (lora_B starts at 0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out / "adapter")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "the LoRA weights did not change"
    assert any(m["grad_norm"] > 0 for m in metrics)


def test_evaluating_during_a_run_changes_none_of_its_training(tmp_path):
    """A run evaluated every step, its held-out samples drawn at temperature 1, trains exactly as one evaluated
    before and after alone: the same completions, rewards and losses (evaluations draw from every stream the
    training does, and give the draws back)."""
    def run(name: str, *extra: str) -> tuple[list, list]:
        out = tmp_path / name
        result = CliRunner().invoke(app, [
            "train", "--task", "addition", "--steps", "2", "-G", "4", "--prompts-per-step", "2",
            "--max-new-tokens", "12", "--eval-prompts", "4", "--seed", "3", "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        lines = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines()]  # noqa: E731
        trained = [(m["reward/mean"], m["loss"], m["completion_len/mean"]) for m in lines("metrics.jsonl")]
        return trained, [s["completion"] for s in lines("samples.jsonl")], lines("eval.jsonl")

    trained, completions, evals = run("evaluated", "--eval-every", "1", "--eval-samples", "2", "--sample-every", "1")
    assert [(e["step"], e["samples_per_prompt"]) for e in evals] == [(0, 2), (1, 2), (2, 2)]
    alone, alone_completions, _ = run("alone", "--sample-every", "1")
    assert completions == alone_completions and len(completions) == 2 * 2 * 4
    assert trained == alone


def test_bad_settings_fail_before_loading():
    result = CliRunner().invoke(app, ["train", "--num-generations", "1"])
    assert result.exit_code != 0
    assert "--num-generations" in result.output and "greater than or equal to 2" in result.output


def test_your_own_reward_and_data_from_the_cli(tmp_path):
    (tmp_path / "reward.py").write_text(
        "from minigrpo import per_sample\n\n"
        "@per_sample\n"
        "def mentions_color(completion: str, color: str, **example) -> float:\n"
        "    return 1.0 if color in completion.lower() else 0.0\n")
    data = tmp_path / "colors.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Name something {c}.", "color": c}) + "\n"
                            for c in ["red", "blue", "green", "yellow"] * 5))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--task", str(data), "--reward", f"{tmp_path / 'reward.py'}:mentions_color", "--steps", "1",
        "--num-generations", "2", "--prompts-per-step", "2", "--max-new-tokens", "8", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/mentions_color/mean" in metrics


def test_a_broken_reward_stops_before_the_model_loads(tmp_path):
    (tmp_path / "reward.py").write_text("def bad(prompts, completions, **kw):\n    return [1.0]\n")
    result = CliRunner().invoke(app, ["train", "--reward", f"{tmp_path / 'reward.py'}:bad", "--steps", "1",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code != 0
    flat = " ".join(result.output.split())  # found on the task's worked examples, or its stand-in completions
    assert "reward function bad returned 1 values for" in flat and "it must return one per completion" in flat
    assert not (tmp_path / "run").exists(), "it stopped before making a run folder or loading a model"


def test_check_reward_samples_the_model_and_warns(tmp_path):
    (tmp_path / "reward.py").write_text("def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    result = CliRunner().invoke(app, ["check-reward", "--task", "addition", "--reward",
                                      f"{tmp_path / 'reward.py'}:zero", "--prompts", "2", "--samples", "2",
                                      "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "4 completions sampled" in result.output
    assert "zero: always zero" in result.output


def test_converting_the_offline_model_leaves_the_seeded_random_stream_alone(tmp_path, monkeypatch):
    """The first run on a machine converts the model after seeding; it must then train as every later run."""
    import torch

    from minigrpo.weights import OFFLINE_HUB_ID, resolve_weights

    monkeypatch.setenv("MINIGRPO_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    folder = resolve_weights(OFFLINE_HUB_ID)
    assert str(tmp_path) in folder and torch.equal(torch.rand(3), expected)


def test_a_run_with_nothing_to_learn_from_is_told_once_and_a_group_with_spread_resets_the_count():
    from pathlib import Path

    from rich.console import Console

    from minigrpo.config import TrainConfig
    from minigrpo.console import Display
    from minigrpo.health import FLAT_STEPS, warn_or_stop

    def warnings(spreads: list[float]) -> list[str]:
        display = Display(len(spreads), Console(record=True, width=400))
        for step, spread in enumerate(spreads, 1):
            metrics = {"step": step} if spread is None else {"step": step, "frac_groups_reward_differs": spread}
            warn_or_stop(TrainConfig(task="rg:chain_sum"), metrics, 0, display, None, Path("."))
        return [line for line in display.console.export_text().splitlines() if "no group has had reward" in line]

    # a step skipped for want of spread (--filter-groups) counts as flat too
    flat = warnings([0.0] * (FLAT_STEPS - 1) + [None] + [0.0] * 10)
    assert len(flat) == 1 and "minigrpo check-reward --task rg:chain_sum --model smollm2-135m" in flat[0]
    assert "shots=2" in flat[0] and "--max-new-tokens (now 48)" in flat[0]
    assert warnings([0.0] * (FLAT_STEPS - 1) + [0.5] + [0.0] * (FLAT_STEPS - 1)) == []
