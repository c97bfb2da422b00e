"""A user's day after training: sample, chat, export (merged and adapter-only), plot."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from minigrpo import TrainConfig, train
from minigrpo.cli.app import app
from minigrpo.trained import load_trained
from minigrpo.logprobs import pad_batch, token_logprobs
from minigrpo.tools import render_prompt


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    # a reward with spread in every group and a high learning rate: the adapter moves far from zero, so a
    # wrong export would show
    (folder / "reward.py").write_text("def letter_e(prompts, completions, **kw):\n"
                                      "    return [c.count('e') / (len(c) + 1) for c in completions]\n")
    (folder / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n"
                                               for w in ["hello", "tree", "eleven", "yes"] * 5))
    return train(TrainConfig(task=str(folder / "data.jsonl"), rewards=[f"{folder / 'reward.py'}:letter_e"], steps=2,
                             num_generations=4, prompts_per_step=2, max_new_tokens=12, learning_rate=3e-3,
                             sample_every=0, seed=2, output_dir=str(folder / "run"), eval_before_after=False,
                             dtype="float32"))  # an exact export is checked against an exact run


def test_sample_and_chat(run):
    result = CliRunner().invoke(app, ["sample", "--adapter", str(run / "adapter"), "What is 2 + 2?", "Add 1 and 5.",
                                      "--samples", "2", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "What is 2 + 2?" in result.output and "Add 1 and 5." in result.output
    result = CliRunner().invoke(app, ["chat", "--adapter", str(run / "adapter"), "--max-new-tokens", "8"],
                                input="hello\nwhat is 3 + 4?\nexit\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("model>") == 2


def test_merged_export_reproduces_the_adapter_model(run, tmp_path):
    policy, tokenizer, _ = load_trained(run / "adapter")
    prompt = tokenizer(render_prompt(tokenizer, "What is 3 + 4?"), add_special_tokens=False).input_ids
    completion = tokenizer("3 + 4 = 7", add_special_tokens=False).input_ids
    ids, attention, _ = pad_batch([(prompt, completion)], 0, "cpu")
    with torch.no_grad():
        trained = token_logprobs(policy, ids, attention, len(completion))
        with policy.disable_adapter():
            base = token_logprobs(policy, ids, attention, len(completion))
    assert (trained - base).abs().max() > 1e-3, "the adapter must matter for this check to mean anything"

    for dtype, tol in (("float32", 1e-4), ("bfloat16", 0.15)):
        out = tmp_path / dtype
        result = CliRunner().invoke(app, ["export", str(run), "--merge", "--out", str(out), "--dtype", dtype])
        assert result.exit_code == 0, result.output
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            exported = token_logprobs(merged, ids, attention, len(completion))
        assert (exported - trained).abs().max() < tol, dtype
    assert json.loads((tmp_path / "bfloat16" / "config.json").read_text()).get("quantization_config") is None


def test_adapter_only_export(run, tmp_path):
    result = CliRunner().invoke(app, ["export", str(run), "--adapter-only", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "adapter_model.safetensors").exists()


def test_merged_export_loads_in_vllm(run, tmp_path):
    pytest.importorskip("vllm")
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    out = tmp_path / "merged"
    assert CliRunner().invoke(app, ["export", str(run), "--out", str(out), "--dtype", "bfloat16"]).exit_code == 0
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, seed=0)
    text = llm.generate(["What is 2 + 2?"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) >= 1
    del llm


def test_plot_writes_a_png(run):
    result = CliRunner().invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    png = run / "curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_writes_into_a_folder_it_is_given_and_says_where(run, tmp_path):
    """`--out FOLDER` wrote FOLDER.png beside it while saying FOLDER; a path without a suffix got one silently."""
    (tmp_path / "figures").mkdir()
    for out, written in ((tmp_path / "figures", tmp_path / "figures" / "curves.png"),
                         (tmp_path / "named", tmp_path / "named.png")):
        result = CliRunner().invoke(app, ["plot", str(run), "--out", str(out)])
        assert result.exit_code == 0 and str(written) in " ".join(result.output.split()).replace(" ", ""), \
            result.output
        assert written.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text, says", [("", "is empty: not a result card"),
                                        ("{not json", "is not valid JSON"),
                                        ('{"trainers": {}}', "is not a result card (bench learn writes them): it has "
                                                             "no eval")])
def test_plot_of_a_broken_card_names_the_file_and_what_is_wrong(tmp_path, text, says):
    card = tmp_path / "card.json"
    card.write_text(text)
    result = CliRunner().invoke(app, ["plot", str(card)])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and str(card) in said.replace(" ", ""), said  # rich may break a long path
    assert says in said and "Traceback" not in said, said


def test_metrics_reach_tensorboard_only_when_asked(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = dict(steps=1, num_generations=2, prompts_per_step=1, max_new_tokens=6, sample_every=0,
                    eval_before_after=False)
    quiet = train(TrainConfig(output_dir=str(tmp_path / "quiet"), **settings))
    assert not (quiet / "tensorboard").exists()
    loud = train(TrainConfig(output_dir=str(tmp_path / "loud"), report_to=["tensorboard"], **settings))
    events = EventAccumulator(str(loud / "tensorboard"))
    events.Reload()
    assert {"reward/mean", "frac_groups_reward_differs", "time/step"} <= set(events.Tags()["scalars"])
