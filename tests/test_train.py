import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from minigrpo.cli import app

STEP_KEYS = {
    "step", "reward/mean", "reward/std", "reward/addition_reward/mean", "frac_groups_reward_differs", "kl",
    "clip_frac", "loss", "completion_len/mean", "completion_len/max", "truncated_frac", "lr", "grad_norm",
    "time/generate", "time/train", "time/step", "tokens_per_s", "mem/peak_gb",
}


def test_train_two_steps_end_to_end(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--model", "smollm2-135m", "--task", "addition", "--steps", "2", "--output-dir", str(out),
        "--num-generations", "4", "--prompts-per-step", "2", "--max-new-tokens", "24", "--micro-batch-size", "3",
        "--beta", "0.04", "--seed", "1", "--sample-every", "1",
    ])
    assert result.exit_code == 0, result.output
    assert "step    2" in result.output and "sample" in result.output

    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 2 and config["num_generations"] == 4 and config["load_in_4bit"] is True

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
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


def test_bad_settings_fail_before_loading():
    result = CliRunner().invoke(app, ["train", "--num-generations", "1"])
    assert result.exit_code != 0
    assert "num_generations" in result.output
