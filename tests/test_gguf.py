"""`minigrpo export RUN --gguf`: one GGUF file and an Ollama Modelfile, read back by independent readers.

transformers loads the file (`gguf_file=`) and must decode as the merged model does; its tokenizer, rebuilt from the
file, must encode as the run's does; the base's tensors, written with no adapter, must equal the ones llama.cpp's
own converter wrote into the offline model's GGUF (names, shapes, the query and key rows' order); and the
Modelfile's template must render a prompt as training rendered it."""

import importlib.util
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from minigrpo.cli.app import app
from minigrpo.config import TrainConfig
from minigrpo.model import load_policy
from minigrpo.tasks import get_task
from minigrpo.tools import render_prompt
from minigrpo.weights import resolve_weights


def _run(folder, scale: float):
    """A run folder whose adapter's B matrices are random (`scale` > 0: a merge that changes every projection)."""
    cfg = TrainConfig(output_dir=str(folder), lora_rank=4, temperature=0.8, top_p=0.95)
    policy = load_policy(cfg, resolve_weights(cfg.hub_id))
    generator = torch.Generator().manual_seed(0)
    for name, parameter in policy.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * scale
    policy.save_pretrained(folder / "adapter")
    cfg.save(folder / "config.json")
    return folder


def export(*args):
    result = CliRunner().invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained-looking run exported three ways: a merged float16 folder, and GGUF files in f16 and q8_0."""
    root = tmp_path_factory.mktemp("gguf")
    run = _run(root / "run", 0.05)
    export(run, "--out", root / "merged", "--dtype", "float16")
    said = export(run, "--gguf", "f16", "--out", root / "gguf")
    export(run, "--gguf", "q8_0", "--out", root / "gguf", "--overwrite")
    return root, said


def _prompts(tokenizer, n=8):
    return [tokenizer(render_prompt(tokenizer, row["prompt"]), add_special_tokens=False).input_ids
            for row in get_task("addition").make_data("test", 0)[:n]]


@pytest.fixture(scope="module")
def merged(exported):
    """The merged float16 folder as transformers loads it, computing in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = exported
    return AutoTokenizer.from_pretrained(root / "merged"), \
        AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()


def _read_back(root, name):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "gguf", gguf_file=name, dtype=torch.float32).eval()


def test_an_f16_file_decodes_as_the_merged_model_and_its_tokenizer_encodes_as_the_runs(exported, merged):
    from transformers import AutoTokenizer

    root, said = exported
    assert "writing" in said and "GB)" in said  # the size, said before writing
    (tokenizer, merged), read_back = merged, _read_back(root, "run-f16.gguf")
    rebuilt = AutoTokenizer.from_pretrained(root / "gguf", gguf_file="run-f16.gguf")
    texts = [render_prompt(tokenizer, row["prompt"]) for row in get_task("addition").make_data("test", 0)[:8]]
    assert [rebuilt(t, add_special_tokens=False).input_ids for t in texts] == \
        [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    for ids in _prompts(tokenizer, 4):
        prompt = torch.tensor([ids])
        ours = merged.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(read_back.generate(prompt, max_new_tokens=16, do_sample=False), ours)


def test_a_q8_0_file_picks_the_merged_models_next_token_nine_times_in_ten(exported, merged):
    """Teacher-forced: at each position of the merged model's greedy continuation, the q8_0 file's argmax. Measured
    on the tiny model, 16 prompts x 32 tokens: 258 of 266 tokens (0.970); q4_0 gave 183 of 266 (0.688)."""
    root, _ = exported
    (tokenizer, merged), read_back = merged, _read_back(root, "run-q8_0.gguf")
    agree = total = 0
    with torch.no_grad():
        for ids in _prompts(tokenizer, 8):
            text = merged.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
            picked = [m(text).logits[0, len(ids) - 1:-1].argmax(-1) for m in (merged, read_back)]
            agree, total = agree + (picked[0] == picked[1]).sum().item(), total + picked[0].numel()
    assert agree / total >= 0.9, (agree, total)


def test_the_base_is_laid_out_as_llama_cpps_own_converter_lays_it_out(tmp_path):
    """No adapter (B = 0): the exported tensors are the offline model's, which came from a GGUF that llama.cpp's
    converter wrote; read back from both files, each must be the same numbers under the same name."""
    import gguf

    from minigrpo.weights import _find_offline_gguf

    export(_run(tmp_path / "run", 0.0), "--gguf", "f32", "--out", tmp_path / "gguf")
    ours = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "gguf" / "run-f32.gguf")).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(str(_find_offline_gguf())).tensors}
    assert set(ours) == set(theirs)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.attn_v.weight",
                 "blk.29.ffn_down.weight", "blk.3.attn_norm.weight", "output_norm.weight"):
        expected = gguf.dequantize(theirs[name].data, theirs[name].tensor_type)
        assert list(ours[name].shape) == list(theirs[name].shape), name
        assert np.array_equal(np.asarray(ours[name].data).reshape(expected.shape), expected), name


def test_the_modelfile_renders_a_prompt_as_training_did(exported):
    root, _ = exported
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "merged")
    text = (root / "gguf" / "Modelfile").read_text()
    assert text.startswith("FROM ./run-q8_0.gguf\n") and 'PARAMETER stop "<|im_end|>"' in text
    assert "PARAMETER temperature 0.8" in text and "PARAMETER top_p 0.95" in text
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    system = re.search(r'SYSTEM """(.*?)"""', text, re.S).group(1)
    assert go_render(template, system, [{"role": "user", "content": "What is 2 + 2?"}]) == \
        render_prompt(tokenizer, "What is 2 + 2?")


def go_render(template: str, system: str, messages: list[dict]) -> str:
    """The Go-template forms the Modelfile uses, rendered as Ollama does: the system block, then each message."""
    system_block = re.search(r"\{\{- if \.System \}\}(.*?)\{\{ end \}\}", template, re.S)
    turn = re.search(r'\{\{- range \.Messages \}\}\{\{- if ne \.Role "system" \}\}(.*?)\{\{ end \}\}\{\{ end \}\}',
                     template, re.S)
    out = system_block.group(1).replace("{{ .System }}", system)
    for message in messages:
        out += turn.group(1).replace("{{ .Role }}", message["role"]).replace("{{ .Content }}", message["content"])
    return out + template[turn.end():]


def test_a_written_file_is_kept_unless_told_and_other_models_are_refused_in_one_line(exported, tmp_path):
    from types import SimpleNamespace

    from minigrpo.to_gguf import refuse_unsupported

    root, _ = exported
    before = (root / "gguf" / "run-q8_0.gguf").stat().st_mtime_ns
    result = CliRunner().invoke(app, ["export", str(root / "run"), "--gguf", "q8_0", "--out", str(root / "gguf")])
    assert result.exit_code == 1 and "give --overwrite to replace them" in " ".join(result.output.split())
    assert (root / "gguf" / "run-q8_0.gguf").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="--gguf writes llama and qwen2 models .* not gpt2"):
        refuse_unsupported(SimpleNamespace(model_type="gpt2", vocab_size=50257), None)


def test_a_16_bit_gguf_is_a_base_and_a_quantized_one_is_refused(exported, tmp_path, monkeypatch):
    from minigrpo.weights import resolve_weights

    root, _ = exported
    monkeypatch.setenv("MINIGRPO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"holds quantized weights \(Q8_0\): train on the model it was made from"):
        resolve_weights(str(root / "gguf" / "run-q8_0.gguf"))
    folder = resolve_weights(str(root / "gguf" / "run-f16.gguf"))  # converted once into the cache
    assert folder.startswith(str(tmp_path / "cache" / "gguf-bases")) and resolve_weights(
        str(root / "gguf" / "run-f16.gguf")) == folder


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama.cpp's Python binding is not installed")
def test_llama_cpp_loads_the_file_and_answers(exported):
    from llama_cpp import Llama

    root, _ = exported
    llm = Llama(model_path=str(root / "gguf" / "run-q8_0.gguf"), n_ctx=512, verbose=False)
    reply = llm.create_chat_completion([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16,
                                       temperature=0)
    assert reply["choices"][0]["message"]["content"].strip()
