"""The knobs from the papers: advantage estimators, GDPO's per-reward normalisation, the entropy bonus (fixed and
adaptive), the KL estimator and reference adapter, the SFT warm-up and forking a run. Each test fails when its knob
is ignored; the end-to-end ones run the real offline model."""

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from minigrpo import loss as L
from minigrpo.cli.app import app
from minigrpo.config import TrainConfig
from minigrpo.graduate import not_carried, trl_settings
from minigrpo.scoring import Scores
from minigrpo.train import step_advantages

TINY = ["--steps", "1", "-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-prompts", "2",
        "--no-eval-before-after"]


def batch_of(values: dict[str, list[float]], weights: list[float]):
    totals = [sum(w * v for w, v in zip(weights, column)) for column in zip(*values.values())]
    return SimpleNamespace(scores=Scores(totals=totals, values=values))


def test_the_advantage_estimator_is_the_one_configured():
    batch = batch_of({"correct": [1, 0, 0, 0, 1, 1, 1, 0]}, [1.0])
    grpo = step_advantages(TrainConfig(num_generations=4, scale_rewards="none"), batch, [1.0])
    rloo = step_advantages(TrainConfig(num_generations=4, scale_rewards="none", advantage="rloo"), batch, [1.0])
    maxrl = step_advantages(TrainConfig(num_generations=4, advantage="maxrl"), batch, [1.0])
    assert grpo.tolist() == [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]
    assert torch.allclose(rloo, grpo * 4 / 3)
    # the hard prompt (1 of 4 solved) gets three times the easy one's (3 of 4) credit for a success
    assert torch.allclose(maxrl, torch.tensor([3., -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1]))


def test_maxrl_takes_no_other_scale():
    with pytest.raises(ValueError, match="maxrl divides by the group's mean success"):
        TrainConfig(advantage="maxrl", scale_rewards="group")
    assert TrainConfig(advantage="maxrl").scale_rewards == "none"


def test_normalize_then_sum_keeps_a_narrow_reward_from_being_drowned():
    values = {"score": [10, 0, 10, 0], "brief": [0, 1, 1, 0]}  # a 0/10 reward and a 0/1 reward, one group
    summed = step_advantages(TrainConfig(num_generations=4, scale_rewards="none"), batch_of(values, [1, 1]), [1, 1])
    gdpo = step_advantages(TrainConfig(num_generations=4, scale_rewards="none", reward_aggregation="normalize_then_sum"),
                           batch_of(values, [1, 1]), [1, 1])
    # summed, "brief" moves the second completion only from -5.5 to -4.5; normalised first, it counts as much
    assert summed.tolist() == [4.5, -4.5, 5.5, -5.5]
    assert gdpo[0].item() == pytest.approx(0.0, abs=1e-3) and gdpo[2].item() == pytest.approx(1.732, abs=1e-3)


def test_the_kl_estimators_and_the_entropy_bonus_change_the_loss():
    torch.manual_seed(0)
    logps = torch.randn(2, 3, requires_grad=True)
    ref, adv, mask = torch.randn(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    kls = {k: L.policy_loss(L.Objective(beta=0.1, kl_estimator=k), logps, logps.detach(), ref, adv, mask)[1]["kl"]
           for k in ("k1", "k2", "k3")}
    assert len(set(kls.values())) == 3 and kls["k2"] >= 0 and kls["k3"] >= 0
    entropy = torch.rand(2, 3, requires_grad=True)
    plain, _ = L.policy_loss(L.Objective(), logps, logps.detach(), None, adv, mask)
    bonus, _ = L.policy_loss(L.Objective(), logps, logps.detach(), None, adv, mask, entropy=entropy, entropy_coef=0.5)
    assert bonus.item() == pytest.approx(plain.item() - 0.5 * entropy.mean().item(), abs=1e-6)
    bonus.backward()
    assert entropy.grad is not None and torch.all(entropy.grad < 0)  # more entropy, lower loss


def test_every_knob_is_refused_with_its_fix_when_out_of_range(tmp_path):
    for flags, says in [(["--advantage", "ppo"], "'ppo' is not one of 'grpo', 'rloo', 'maxrl'"),
                        (["--kl-estimator", "k4"], "'k4' is not one of 'k1', 'k2', 'k3'"),
                        (["--reward-aggregation", "max"], "'max' is not one of 'sum', 'normalize_then_sum'"),
                        (["--entropy-coef", "-1"], "'--entropy-coef': Input should be greater than or equal to 0"),
                        (["--reference-adapter", str(tmp_path)], "reference_adapter is the KL's reference: it needs"),
                        (["--init-adapter", str(tmp_path)], "is not an adapter folder")]:
        result = CliRunner().invoke(app, ["train", *flags, "--out", str(tmp_path / "run")])
        assert result.exit_code != 0 and says in " ".join(result.output.split()), result.output


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def warmup(tmp_path_factory) -> Path:
    """An SFT warm-up's adapter on one-digit sums, from the command line."""
    folder = tmp_path_factory.mktemp("sft")
    rows = [{"prompt": f"What is {a} + {b}?", "completion": f"{a + b}"} for a in range(4) for b in range(4)]
    (folder / "warmup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["sft", "--task", str(folder / "warmup.jsonl"), "--out", str(folder / "out"),
                                      "--epochs", "2", "--learning-rate", "1e-3"])
    assert result.exit_code == 0, result.output
    record = json.loads((folder / "out" / "sft.json").read_text())
    assert record["examples"] == 16 and record["losses"][1] < record["losses"][0]  # it learned the completions
    return folder / "out" / "adapter"


def test_sft_refuses_rows_it_cannot_learn_from(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    result = CliRunner().invoke(app, ["sft", "--task", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "an SFT row has `prompt` and `completion`" in " ".join(result.output.split())


def test_init_adapter_starts_from_the_warmup_and_reference_adapter_is_the_kls_reference(warmup, tmp_path):
    runs = {}
    for name, flags in [("base_k3", []), ("base_k1", ["--kl-estimator", "k1"]),
                        ("own_reference", ["--reference-adapter", str(warmup)])]:
        result = CliRunner().invoke(app, ["train", *TINY, "--init-adapter", str(warmup), "--beta", "0.1", *flags,
                                          "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        runs[name] = read_metrics(tmp_path / name)[0]["kl"]
    # started from the warm-up, the policy is not the base: a KL to the base; none to its own starting point
    assert runs["base_k3"] > 1e-4 and runs["own_reference"] == pytest.approx(0.0, abs=1e-6)
    assert runs["base_k1"] != pytest.approx(runs["base_k3"], rel=1e-3)


def test_the_adaptive_entropy_coefficient_moves_and_survives_a_resume(tmp_path):
    run = tmp_path / "run"
    flags = [*TINY[2:], "--entropy-coef", "0.01", "--entropy-target", "100", "--save-every", "1"]
    first = CliRunner().invoke(app, ["train", "--steps", "2", *flags, "--out", str(run)])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["train", "--resume", str(run), "--steps", "3"])
    assert again.exit_code == 0, again.output
    # below the target every step, the coefficient rises by 0.005 a step, across the resume
    assert [round(m["entropy_coef"], 6) for m in read_metrics(run)] == [0.01, 0.015, 0.02]


def test_a_fork_starts_from_the_parents_checkpoint_with_its_changes(tmp_path):
    parent = tmp_path / "parent"
    trained = CliRunner().invoke(app, ["train", "--steps", "2", *TINY[2:], "--save-every", "1", "--out",
                                       str(parent)])
    assert trained.exit_code == 0, trained.output
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in parent.rglob("*") if p.is_file()}
    child = tmp_path / "child"
    forked = CliRunner().invoke(app, ["train", "--fork", f"{parent}@1", "--learning-rate", "1e-3", "--steps", "3",
                                      "--out", str(child)])
    assert forked.exit_code == 0, forked.output
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in parent.rglob("*") if p.is_file()} == before
    config = json.loads((child / "config.json").read_text())
    assert config["forked_from"] == f"{parent}@1" and config["learning_rate"] == 1e-3
    metrics = read_metrics(child)
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[0] == read_metrics(parent)[0]  # its history to 1
    assert [m["lr"] for m in metrics[1:]] == [1e-3, 1e-3]
    for flags, says in [([f"{parent}@7"], "kept no checkpoint at step 7; it kept 1, 2"),
                        ([f"{parent}@2"], "give --steps above 2"),
                        ([f"{parent}@1", "--model", "smollm2-360m"], "a fork keeps it"),
                        ([f"{parent}@1", "--task", "countdown", "--steps", "3"], "a fork keeps --task")]:
        result = CliRunner().invoke(app, ["train", "--fork", *flags, "--out", str(tmp_path / "x")])
        assert result.exit_code != 0 and says in " ".join(result.output.split()), result.output
        assert not (tmp_path / "x").exists(), "nothing written"


def test_graduate_carries_what_trl_has_and_lists_what_it_has_not():
    cfg = TrainConfig(advantage="rloo", kl_estimator="k2", reward_aggregation="normalize_then_sum",
                      entropy_coef=0.01, entropy_target=0.3)
    settings = trl_settings(cfg, 1)
    assert settings["multi_objective_aggregation"] == "normalize_then_sum"
    assert (settings["entropy_coef"], settings["use_adaptive_entropy"], settings["entropy_target"]) == (0.01, True, 0.3)
    missing = " ".join(not_carried(cfg))
    assert "--advantage rloo" in missing and "--kl-estimator k2" in missing
    assert not_carried(TrainConfig()) == []


def test_maxrl_with_rewards_below_zero_says_so_and_spread_counts_groups_with_gradient(tmp_path):
    """A penalty below 0 (the built-in overlong one goes to -1) under --advantage maxrl: every group's advantage was
    0 while the screen showed spread 1.00. Now "spread" is the share of groups that carry a gradient, and the run
    warns once, naming what to use instead."""
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    (tmp_path / "negative.py").write_text("def minus(completions, **kwargs):  # 0 once, then -1: spread, mean below 0\n"
                                          "    return [-float(i % 4 > 0) for i in range(len(completions))]\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--advantage", "maxrl", "--reward", f"{tmp_path / 'negative.py'}:minus",
                                      "--reward-weight", "0", "--reward-weight", "1", "--steps", "1", "-G", "4",
                                      "--prompts-per-step", "2", "--max-new-tokens", "6", "--no-eval-before-after",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["frac_groups_reward_differs"] == 0.0 and metrics["maxrl/groups_below_zero"] > 0, metrics
    assert "--advantage maxrl reads rewards as successes in [0, 1]" in result.output.replace("\n", " "), result.output


def test_an_adapter_made_with_another_alpha_keeps_its_own_effect(tiny_model_path, tmp_path):
    """PEFT's default lora_alpha is 8; a run's is twice its rank. Loaded at the run's scale, such an adapter had
    four times its effect (32/16 instead of 8/16), silently. It now acts as PEFT itself loads it."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from minigrpo.adapters import start_from
    from minigrpo.model import load_base, load_policy

    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                            LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
    theirs.save_pretrained(tmp_path / "theirs")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        peft = PeftModel.from_pretrained(load_base(tiny_model_path, False, torch.float32), str(tmp_path / "theirs"))
        expected = peft(input_ids=ids).logits
        with peft.disable_adapter():
            effect = (expected - peft(input_ids=ids).logits).abs().max()
        ours = load_policy(TrainConfig(lora_rank=16, load_in_4bit=False, dtype="float32", bf16_base=False),
                           tiny_model_path, torch.float32)
        got = start_from(ours, str(tmp_path / "theirs"), None)(input_ids=ids).logits
    # the two loads may pick different attention kernels (a few 1e-3 apart); four times the effect is far more
    assert effect > 0.5 and (got - expected).abs().max() < 0.02 * effect, ((got - expected).abs().max(), effect)


@pytest.mark.parametrize("damage, says", [
    ("no weights", "no adapter weights in it"),
    ("broken config", "its adapter_config.json is not valid JSON"),
    ("another model", "was made for meta-llama/Llama-3.2-1B-Instruct, and this run trains"),
])
def test_an_adapter_folder_that_cannot_serve_is_one_line_before_the_model_loads(warmup, tmp_path, damage, says):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(warmup, folder)
    config = folder / "adapter_config.json"
    if damage == "no weights":
        (folder / "adapter_model.safetensors").unlink()
    elif damage == "broken config":
        config.write_text(config.read_text()[:-10])
    else:
        config.write_text(json.dumps({**json.loads(config.read_text()),
                                      "base_model_name_or_path": "meta-llama/Llama-3.2-1B-Instruct"}))
    for flag in ("--init-adapter", "--reference-adapter"):
        result = CliRunner().invoke(app, ["train", *TINY, flag, str(folder), "--beta", "0.1",
                                          "--out", str(tmp_path / "run")])
        said = " ".join(result.output.split())
        assert result.exit_code in (1, 2) and f"{flag} {folder}" in said and says in said, result.output
        assert "loading" not in said and "Traceback" not in said and not (tmp_path / "run").exists()


def test_sft_builds_no_generator_and_skips_a_step_that_is_not_finite(tmp_path, monkeypatch):
    """SFT samples nothing, so it builds no generator (a fixed-shape decoder's dense copy of a 4-bit base is
    gigabytes); a step whose loss is not finite (float16 overflowing) is skipped, not written into the adapter."""
    import torch
    from safetensors.torch import load_file

    import minigrpo.logprobs
    from minigrpo import startup
    from minigrpo.config import TrainConfig
    from minigrpo.sft import sft

    def no_generator(*args, **kwargs):
        raise AssertionError("SFT built a generator")

    real = minigrpo.logprobs.token_logprobs
    calls = []

    def first_overflows(*args, **kwargs):  # the first micro-batch's log-probs overflow, as float16's can
        logps = real(*args, **kwargs)
        calls.append(1)
        return logps * float("nan") if len(calls) == 1 else logps

    monkeypatch.setattr(startup, "make_generator", no_generator)
    monkeypatch.setattr(minigrpo.logprobs, "token_logprobs", first_overflows)
    rows = [{"prompt": f"What is {a} + {b}?", "completion": f"{a + b}"} for a in range(3) for b in range(3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter = sft(TrainConfig(micro_batch_size=4, learning_rate=1e-3), tmp_path / "rows.jsonl", tmp_path / "out",
                  epochs=1, say=lambda _: None)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(t.abs().sum() > 0 for name, t in weights.items() if "lora_B" in name), "the finite steps applied"
    record = json.loads((tmp_path / "out" / "sft.json").read_text())
    assert record["skipped_steps"] == {"overflow": 0, "nonfinite": 1} and len(calls) == 3


@pytest.mark.parametrize("extra, says", [(dict(modules_to_save=["lm_head"]), "modules_to_save (lm_head)"),
                                         (dict(use_dora=True), "DoRA magnitudes"),
                                         (dict(bias="lora_only"), "biases")])
def test_an_adapter_carrying_more_than_lora_is_refused_before_it_can_touch_the_base(tmp_path, tiny_model_path,
                                                                                      extra, says):
    """A PEFT or TRL adapter saved with `modules_to_save=["lm_head"]` was copied into the frozen base by
    --init-adapter (a zeroed head: the first step's entropy was ln(vocab)); now any adapter holding more than LoRA's
    A and B is refused in one line, before the model loads and before a run folder is made."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM", **extra))
    peft.save_pretrained(tmp_path / "adapter")
    for flags in (["--init-adapter"], ["--beta", "0.04", "--reference-adapter"]):
        result = CliRunner().invoke(app, ["train", *flags, str(tmp_path / "adapter"), "--steps", "1",
                                          "--out", str(tmp_path / "run")])
        said = " ".join(result.output.split())
        assert result.exit_code != 0 and says in said and "LoRA weights only" in said, said
        assert not (tmp_path / "run").exists()
