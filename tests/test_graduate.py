"""`minigrpo graduate`: the folder it writes, its script run for real under TRL on CPU, the adapter read back
by minigrpo; and the loss presets mapped to TRL's settings."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from minigrpo import TrainConfig
from minigrpo.cli.app import app
from minigrpo.graduate import accelerate_yaml, trl_settings

pytest.importorskip("trl")

REWARD = '''import json, os

def counted(prompts, completions, **kwargs):
    """1.0 for a reply under 40 characters; records who called it and with what."""
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"n": len(completions), "kwargs": sorted(kwargs)}) + "\\n")
    text = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) < 40) for t in text]
'''


def test_the_graduated_script_trains_under_trl_and_minigrpo_reads_the_adapter(tmp_path):
    (tmp_path / "my_reward.py").write_text(REWARD)
    out = tmp_path / "trl"
    result = CliRunner().invoke(app, ["graduate", "--out", str(out), "--gpus", "1", "--", "--task", "addition",
                                      "--reward", str(tmp_path / "my_reward.py") + ":counted", "-G", "2",
                                      "--prompts-per-step", "2", "--max-new-tokens", "12", "--steps", "30"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"train_trl.py", "accelerate.yaml", "README.md", "minigrpo_config.json"}
    script = (out / "train_trl.py").read_text()
    assert "loss_type='dapo'" in script and "num_generations=2" in script and "per_device_train_batch_size=4" in script
    assert "| loss |" in (out / "README.md").read_text()

    env = dict(os.environ, REWARD_LOG=str(tmp_path / "calls.jsonl"), TRL_EXPERIMENTAL_SILENCE="1")
    run = subprocess.run([sys.executable, "train_trl.py", "--cpu", "--max-steps", "2", "--output-dir",
                          str(tmp_path / "trl-out")], cwd=out, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) >= 2 and all(c["n"] == 4 for c in calls)
    assert "trainer_state" in calls[0]["kwargs"]  # called by TRL's GRPOTrainer, which passes its state
    assert (tmp_path / "trl-out" / "adapter_model.safetensors").exists()

    evaluated = CliRunner().invoke(app, ["eval", "--task", "addition", "--adapter", str(tmp_path / "trl-out"),
                                         "--prompts", "4", "--samples", "1", "--max-new-tokens", "12",
                                         "--out", str(tmp_path / "evals")])
    assert evaluated.exit_code == 0 and "adapter" in evaluated.output and "pass@1" in evaluated.output, evaluated.output
    sampled = CliRunner().invoke(app, ["sample", "What is 2 + 2?", "--adapter", str(tmp_path / "trl-out"),
                                       "--max-new-tokens", "8"])
    assert sampled.exit_code == 0 and "What is 2 + 2?" in sampled.output, sampled.output


def test_graduate_from_a_run_continues_its_adapter_under_trl(tmp_path):
    from minigrpo import train

    run = train(TrainConfig(steps=1, num_generations=2, prompts_per_step=2, max_new_tokens=8, sample_every=0,
                            eval_before_after=False, output_dir=str(tmp_path / "run")))
    out = tmp_path / "trl"
    result = CliRunner().invoke(app, ["graduate", str(run), "--gpus", "4", "--out", str(out), "--init-adapter",
                                      str(run / "adapter")])
    assert result.exit_code == 0, result.output
    script = (out / "train_trl.py").read_text()
    assert "per_device_train_batch_size=1" in script and str((run / "adapter").resolve()) in script
    assert "num_processes: 4" in (out / "accelerate.yaml").read_text()
    run_trl = subprocess.run([sys.executable, "train_trl.py", "--cpu", "--max-steps", "1", "--output-dir",
                              str(tmp_path / "trl-out")], cwd=out, capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"))
    assert run_trl.returncode == 0, run_trl.stdout[-3000:] + run_trl.stderr[-3000:]
    assert (tmp_path / "trl-out" / "adapter_model.safetensors").exists()


def said(result) -> str:
    return " ".join(result.output.split())  # the console wraps long lines


def test_graduate_refuses_what_it_cannot_write(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    runner = CliRunner()
    result = runner.invoke(app, ["graduate", "--out", str(tmp_path / "taken"), "--", "--task", "addition"])
    assert result.exit_code == 1 and "not empty" in said(result) and (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    result = runner.invoke(app, ["graduate", "--out", str(tmp_path / "x"), "--gpus", "3", "--", "--task", "addition"])
    assert result.exit_code == 1 and "do not split evenly over 3 GPUs" in said(result)
    result = runner.invoke(app, ["graduate", str(tmp_path), "--out", str(tmp_path / "y")])
    assert result.exit_code == 1 and "is not a run folder" in said(result)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("loss, expected", [
    ("grpo", dict(loss_type="grpo", scale_rewards="group", importance_sampling_level="token")),
    ("dr_grpo", dict(loss_type="dr_grpo", scale_rewards="none")),
    ("dapo", dict(loss_type="dapo", scale_rewards="group")),
    ("bnpo", dict(loss_type="dapo", scale_rewards="batch")),  # token mean over the whole step, as ours
    ("gspo", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)),
    ("cispo", dict(loss_type="cispo", epsilon_high=5.0)),  # TRL's cap is epsilon_high itself
])
def test_each_loss_preset_maps_to_trl(loss, expected):
    from trl import GRPOConfig

    settings = trl_settings(TrainConfig(loss=loss, num_generations=4, prompts_per_step=2), gpus=2)
    assert {k: settings[k] for k in expected} == expected and settings["per_device_train_batch_size"] == 4
    # TRL takes every setting as written
    config = GRPOConfig(output_dir="unused", use_cpu=True, **dict(settings, bf16=False, use_vllm=False))
    assert (config.loss_type, config.num_generations, config.epsilon_high) == (
        settings["loss_type"], 4, settings["epsilon_high"])


def test_the_accelerate_config_names_the_gpus_and_the_backend(tmp_path):
    import yaml

    from minigrpo.graduate import graduate

    zero2 = yaml.safe_load(accelerate_yaml(4))
    assert zero2["num_processes"] == 4 and zero2["deepspeed_config"]["zero_stage"] == 2
    assert yaml.safe_load(accelerate_yaml(8, "zero3"))["deepspeed_config"]["zero_stage"] == 3
    assert yaml.safe_load(accelerate_yaml(2, "fsdp"))["fsdp_config"]["fsdp_version"] == 2
    with pytest.raises(ValueError, match="--backend must be zero2, zero3 or fsdp"):  # before anything is written
        graduate(TrainConfig(), tmp_path / "out", 2, "ddp")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's GRPOTrainer, built by a graduated script for the tiny model (on CPU, no step taken)."""
    import importlib.util

    from minigrpo.graduate import graduate

    folder = graduate(TrainConfig(num_generations=2, prompts_per_step=2, max_new_tokens=8),
                      tmp_path_factory.mktemp("graduated") / "trl")
    spec = importlib.util.spec_from_file_location("train_trl", folder / "train_trl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    trainer = script.build(str(folder / "out"), 1, cpu=True)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("loss, beta, quantile", [("grpo", 0.0, 1.0), ("dr_grpo", 0.04, 1.0), ("dapo", 0.0, 0.5),
                                                  ("bnpo", 0.04, 1.0), ("gspo", 0.0, 1.0), ("cispo", 0.0, 0.5)])
def test_each_loss_preset_gives_trls_loss_and_gradient(trl_trainer, loss, beta, quantile):
    """TRL's own _compute_loss (the installed version) on the same log-probs, advantages and masks, with
    the settings `graduate` maps the preset to: the same loss and the same gradient as ours."""
    import torch

    import dataclasses

    from minigrpo.loss import Objective, advantages, policy_loss

    cfg = TrainConfig(loss=loss, beta=beta, top_entropy_quantile=quantile, epsilon_high=None if loss in ("gspo", "cispo")
                      else 0.28, num_generations=2, prompts_per_step=2, max_new_tokens=6)
    settings = trl_settings(cfg, gpus=1)
    trainer = trl_trainer
    for name, value in dict(loss_type=settings["loss_type"], importance_sampling_level=settings["importance_sampling_level"],
                            epsilon_low=settings["epsilon"], epsilon_high=settings["epsilon_high"], beta=beta,
                            top_entropy_quantile=quantile, max_completion_length=6).items():
        setattr(trainer, name, value)
    trainer.args.use_bias_correction_kl = settings["use_bias_correction_kl"]
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    logps = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    old = logps.detach() + 0.2 * torch.randn(B, T, generator=g)
    if loss == "gspo":  # ratios within GSPO's narrow clip range, so some completions are not clipped
        old = logps.detach() + 2e-4 * torch.randn(B, T, generator=g)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    adv = advantages(torch.tensor([1.0, 0.0, 0.3, 0.9]), 2, cfg.scale_rewards)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropy, None)
    inputs = {"prompt_ids": torch.ones(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3, dtype=torch.long),
              "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(trainer.model, inputs)
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    selected = None
    if quantile < 1:
        from minigrpo.loss import high_entropy

        selected = high_entropy(entropy, mask, quantile)
    objective = dataclasses.replace(Objective.of(cfg), beta=beta, max_tokens=6, tis_cap=0.0)
    ours, _ = policy_loss(objective, logps, old, ref, adv, mask, selected=selected)
    (grad_ours,) = torch.autograd.grad(ours, logps)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours.item(), theirs.item())
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    assert grad_ours.abs().sum() > 0


# every kind of reward that trains in minigrpo, each recording what it was given
KINDS = '''import asyncio, json, os
from minigrpo import per_sample


def _record(name, completions, **kwargs):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"name": name, "types": sorted({type(c).__name__ for c in completions}),
                            "kwargs": sorted(kwargs)}) + "\\n")


def batch(prompts, completions, **kwargs):
    _record("batch", completions, **kwargs)
    return [float(len(str(c)) < 200) for c in completions]


@per_sample
def one_by_one(completion, **example):
    _record("one_by_one", [completion], **example)
    return 0.5 if completion.strip() else 0.0


async def later(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    _record("later", completions, **kwargs)
    return [1.0] * len(completions)


def text(prompts, completions, **kwargs):
    _record("text", completions, **kwargs)
    return [float(p.startswith("What") and c.count(" ") >= 0) for p, c in zip(prompts, completions)]  # strings


def messages(prompts, completions, **kwargs):
    _record("messages", completions, **kwargs)
    return [float(p[-1]["role"] == "user" and c[-1]["role"] == "assistant") for p, c in zip(prompts, completions)]


def parts(completions, **kwargs):
    _record("parts", completions, **kwargs)
    return [{"short": 0.25, "kind": 0.25} for _ in completions]


def flaky(completions, **kwargs):
    _record("flaky", completions, **kwargs)
    raise ValueError("not today")
'''


@pytest.mark.parametrize("data, kinds", [
    ("addition", ["batch", "one_by_one", "later", "text", "parts", "flaky"]),
    ("chat.jsonl", ["batch", "one_by_one", "later", "messages"]),
], ids=["text prompts", "chat prompts"])
def test_every_reward_kind_runs_under_trl_as_it_does_here(tmp_path, data, kinds):
    (tmp_path / "kinds.py").write_text(KINDS)
    if data == "chat.jsonl":
        (tmp_path / data).write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {n} + 1?"}]})
                                             + "\n" for n in range(12)))
        data = str(tmp_path / data)
    rewards = [arg for kind in kinds for arg in ("--reward", f"{tmp_path / 'kinds.py'}:{kind}")]
    out = tmp_path / "trl"
    result = CliRunner().invoke(app, ["graduate", "--out", str(out), "--", "--task", data, *rewards, "-G", "2",
                                      "--prompts-per-step", "2", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    env = dict(os.environ, REWARD_LOG=str(tmp_path / "calls.jsonl"), TRL_EXPERIMENTAL_SILENCE="1")
    run = subprocess.run([sys.executable, "train_trl.py", "--cpu", "--max-steps", "1", "--output-dir",
                          str(tmp_path / "trl-out")], cwd=out, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]  # the raising reward did not stop it
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    called = {c["name"] for c in calls}
    assert called == set(kinds), called
    shape = "list" if "chat" in data else "str"  # what minigrpo gives these rewards, TRL now too
    assert all(c["types"] == [shape] for c in calls if c["name"] != "one_by_one"), calls
    assert all("trainer_state" in c["kwargs"] for c in calls)
    assert "flaky" not in kinds or "not today" in run.stdout + run.stderr  # named, and scored 0


def test_an_environments_own_reward_is_counted_once_under_trl(tmp_path):
    from minigrpo.graduate import trl_rewards
    from minigrpo.tasks import get_task

    (tmp_path / "env.py").write_text(
        "class Counter:\n    def reset(self, **row):\n        self.n = 0\n"
        "    def bump(self) -> int:\n        \"\"\"Add one.\"\"\"\n        self.n += 1\n        return self.n\n"
        "    def get_reward(self):\n        return float(self.n)\n")
    (tmp_path / "r.py").write_text("def r(completions, **kw):\n    return [0.0] * len(completions)\n")
    task = get_task("addition", [f"{tmp_path / 'r.py'}:r"], environment=f"{tmp_path / 'env.py'}:Counter")
    assert [getattr(fn, "__name__", "") for fn in task.rewards][-1] == "Counter"  # minigrpo scores it
    rewards, weights = trl_rewards(task)
    assert [fn.__name__ for fn in rewards] == ["addition_reward", "r"] and len(weights) == 2  # TRL adds Counter


def test_a_tool_task_needs_a_template_with_tools_under_trl(tmp_path):
    result = CliRunner().invoke(app, ["graduate", "--out", str(tmp_path / "trl"), "--", "--task", "multiply",
                                      "--max-turns", "3", "--max-new-tokens", "64"])
    assert result.exit_code == 1 and "chat template has no tool support" in said(result), result.output
    assert "qwen-1.5b" in said(result) and not (tmp_path / "trl").exists()
    from minigrpo.graduate import trl_settings
    from minigrpo import settle
    from minigrpo.tasks import get_task

    cfg = settle.episode_budget(TrainConfig(task="multiply", max_turns=3, max_new_tokens=64), get_task("multiply"))
    assert trl_settings(cfg, 1)["max_completion_length"] == 3 * 64  # the episode's budget, not one turn's
