"""What would end or spoil a first run on a card, each proven on a CPU: the real mechanism where it runs here (the
sampler, the fixed-shape decoder, the update, vLLM's CPU engine), the facts of a card as stand-ins where it does
not. docs/gpu.md ("Before the first run on a card") says what each one was."""

import gc
import weakref

import pytest
import torch

from minigrpo.config import MICRO_BATCH, TrainConfig
from minigrpo.errors import SetupError
from minigrpo.generate import Sampling
from minigrpo.generate.hf import HFGenerator
from minigrpo.model import load_policy, load_tokenizer, lora_parameters
from minigrpo.rollout import Groups
from minigrpo.tools import render_prompt
from minigrpo.generate.sampling import sample
from minigrpo.scoring import Scores


# --- the draw: never a token outside the nucleus --------------------------------------------------------------

def test_no_token_outside_the_nucleus_is_drawn_whatever_a_scan_rounds(monkeypatch):
    """On a card, `cumsum` is a parallel scan: its later partial sums can round above the sum at the last kept
    token. A draw that searches a cumulative sum then lands on a masked token (log-prob -inf, into the loss).
    Stand-ins: such a scan (the second half of every cumulative sum one ulp high) and the uniform draw at its
    top. The exponential race never reads a cumulative sum to draw: every token comes from the nucleus."""
    real = torch.Tensor.cumsum

    def scan(self, dim, *args, **kwargs):
        out = real(self, dim, *args, **kwargs)
        late = torch.arange(out.shape[-1]) >= out.shape[-1] // 2  # [V]
        return out + late * 1e-6

    monkeypatch.setattr(torch.Tensor, "cumsum", scan)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.zeros(*shape, **kw))  # the top of (0, total]
    logits = torch.tensor([[0.6, 0.3, 0.05, 0.05] + [1e-9] * 4]).log()  # [1, 8]: one row left, as at a rollout's end
    for seed in range(200):
        torch.manual_seed(seed)
        token, logp = sample(logits, Sampling(1, 1, temperature=1.0, top_p=0.7))  # the nucleus: tokens 0 and 1
        assert token.item() in (0, 1) and torch.isfinite(logp).all(), (seed, token, logp)


# --- importance weights at top-p < 1 ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    policy = load_policy(TrainConfig(lora_rank=8, load_in_4bit=False, dtype="float32", bf16_base=False),
                         tiny_model_path, torch.float32)
    return policy, tokenizer


def _prompt_ids(tokenizer, texts):
    return [tokenizer(render_prompt(tokenizer, t), add_special_tokens=False).input_ids for t in texts]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_importance_weights_are_one_when_sampler_and_trainer_are_one_policy_at_top_p(tiny, temperature):
    """The sampler's own log-probs forced into the loss (as on a card), at top-p 0.7: a sampler renormalises over
    its nucleus, the trainer does not. Put on one footing, the importance weights' mean is 1 and the gap ~0
    (before, both read the nucleus mass: a mean weight near 0.9 and a gap warning every step)."""
    from minigrpo.loss import Objective
    from minigrpo.update import micro_batches, policy_update

    policy, tokenizer = tiny
    cfg = TrainConfig(lora_rank=8, load_in_4bit=False, dtype="float32", bf16_base=False, top_p=0.7,
                      temperature=temperature, num_generations=8, prompts_per_step=2, max_new_tokens=24)
    generator = HFGenerator(policy, tokenizer, report_logprobs=True, decoder="eager")
    prompt_ids = _prompt_ids(tokenizer, ["Tell me a story about a cat.", "What is 3 + 5?"])
    torch.manual_seed(0)
    out = generator.generate(prompt_ids, Sampling(8, 24, temperature, 0.7))
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    batch = Groups(rows, prompt_ids, out.completion_ids, [""] * 16, out.truncated, out.sampler_logps,
                   Scores([0.0] * 16, {}))
    mb = micro_batches(cfg, batch, tokenizer.pad_token_id, policy.device)
    optimizer = torch.optim.SGD(lora_parameters(policy), lr=0.0)
    update = policy_update(cfg, Objective.of(cfg), policy, mb, torch.randn(16), optimizer,
                           torch.amp.GradScaler("cpu", enabled=False))
    tokens = mb.full_mask.sum().item()
    assert abs(update.weight_sum / tokens - 1) < 0.01, update.weight_sum / tokens
    assert update.gap_sum / tokens < 1e-3 and update.gap_max < 1e-2, (update.gap_sum / tokens, update.gap_max)


def test_a_group_that_scored_alike_is_measured_but_not_back_propagated(tiny, monkeypatch):
    """Rows whose advantages are all 0 add exactly nothing to the gradient (no KL, no entropy bonus), so the update
    runs their forward without autograd and no backward. Two steps, one with a group that scored alike and one where
    every group did, give the adapter, loss and metrics of the update that back-propagates everything, bit for bit:
    the second step moves AdamW on zero gradients, as a zero loss would."""
    from minigrpo import update
    from minigrpo.loss import Objective
    from minigrpo.update import micro_batches, policy_update

    policy, tokenizer = tiny
    cfg = TrainConfig(lora_rank=8, load_in_4bit=False, dtype="float32", bf16_base=False, num_generations=4,
                      prompts_per_step=2, max_new_tokens=12, micro_batch_size=4)
    prompt_ids = _prompt_ids(tokenizer, ["Tell me a story about a cat.", "What is 3 + 5?"])
    torch.manual_seed(0)
    out = HFGenerator(policy, tokenizer, decoder="eager").generate(prompt_ids, Sampling(4, 12, 1.0, 1.0))
    batch = Groups([{"prompt": "a"}, {"prompt": "b"}], prompt_ids, out.completion_ids, [""] * 8, out.truncated,
                   None, Scores([0.0] * 8, {}))
    mb = micro_batches(cfg, batch, tokenizer.pad_token_id, policy.device)
    steps = [torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]), torch.zeros(8)]
    lora = lora_parameters(policy)
    start = [p.detach().clone() for p in lora]
    graded_forwards = []
    hook = policy.get_base_model().model.register_forward_hook(
        lambda *_: graded_forwards.append(torch.is_grad_enabled()))

    def run(skipping: bool):
        if not skipping:
            monkeypatch.setattr(update.L, "carries_gradient", lambda *args, **kwargs: True)  # the loss it calls
        with torch.no_grad():
            for p, s in zip(lora, start):
                p.copy_(s)
        optimizer = torch.optim.AdamW(lora, lr=1e-3)
        graded_forwards.clear()
        policy.train()
        updates, moved = [], []
        for advantages in steps:
            before = [p.detach().clone() for p in lora]
            u = policy_update(cfg, Objective.of(cfg), policy, mb, advantages, optimizer,
                              torch.amp.GradScaler("cpu", enabled=False))
            updates.append((u.totals, u.grad_norm))
            moved.append(any(not torch.equal(p, b) for p, b in zip(lora, before)))
        monkeypatch.undo()
        return [p.detach().clone() for p in lora], updates, moved, sum(graded_forwards)

    try:
        skipped, everything = run(skipping=True), run(skipping=False)
    finally:
        hook.remove()
        policy.eval()
    assert everything[3] == 4 * skipped[3] > 0  # one micro-batch of four back-propagated, against all four
    assert all(torch.equal(a, b) for a, b in zip(skipped[0], everything[0]))
    assert skipped[1] == everything[1] and skipped[2] == everything[2] == [True, True]


# --- a closed engine gives everything back; float16 is judged before any engine starts -----------------------

def test_a_closed_engine_leaves_nothing_frozen_or_alive_and_a_second_one_starts(tiny_model_path, monkeypatch):
    """vLLM 0.11.1 to 0.19 freeze the collector when the engine core starts in this process and never undo it: the
    engine and the policy alive at that moment (both hold reference cycles) would outlive `close`, and a second
    engine (the float32 reload, a notebook cell run twice) would meet a card still full. Stand-in for those
    versions: the real CPU engine, the `gc.unfreeze()` calls that 0.20 on make at shutdown taken out."""
    pytest.importorskip("vllm")
    import types

    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.engine.core as core
    import vllm.v1.worker.gpu_worker as worker

    from minigrpo.generate.vllm_engine import VLLMGenerator

    names = {name: getattr(gc, name) for name in dir(gc) if not name.startswith("_")}
    for module in (core, parallel_state, worker):
        monkeypatch.setattr(module, "gc", types.SimpleNamespace(**{**names, "unfreeze": lambda: None}))
    tokenizer = load_tokenizer(tiny_model_path)

    def start(policy):
        return VLLMGenerator.start(policy, tokenizer, lora_rank=8, max_model_len=128, seed=0, max_rows=4,
                                   gpu_memory_utilization=None, sleep=False, dtype=torch.float32)

    policy = load_policy(TrainConfig(lora_rank=8, load_in_4bit=True), tiny_model_path, torch.float32)
    engine = start(policy)
    assert gc.get_freeze_count() > 0, "the stand-in froze the collector, as those versions do"
    engine_ref, policy_ref = weakref.ref(engine.llm), weakref.ref(policy)
    engine.close()
    del policy  # replaced, as by the float32 reload
    gc.collect()
    assert gc.get_freeze_count() == 0, "close leaves nothing frozen"
    assert engine_ref() is None and policy_ref() is None, "the closed engine and the replaced policy are gone"

    second = start(load_policy(TrainConfig(lora_rank=8, load_in_4bit=True), tiny_model_path, torch.float32))
    try:
        prompt = _prompt_ids(tokenizer, ["Name a colour."])
        assert second.generate(prompt, Sampling(2, 4, 1.0)).completion_ids
    finally:
        second.close()


def test_float16_is_judged_on_the_trainer_before_any_engine_starts(monkeypatch, tiny_model_path, tmp_path,
                                                                  overflowing_copy):
    """A T4's facts as stand-ins: float16 chosen, a model that overflows in it, vLLM asked for. The check runs on
    the trainer alone, the run reloads in float32, and only then does an engine start: one engine, in float32."""
    from minigrpo import startup
    from minigrpo.hardware import CARDS

    started = []
    monkeypatch.setattr(startup, "this_gpu", lambda: CARDS["t4"])
    monkeypatch.setattr(startup, "vllm_available", lambda: True)
    monkeypatch.setattr(startup.VLLMGenerator, "start",
                        classmethod(lambda cls, model, tokenizer, **kw: started.append(kw["dtype"]) or
                                    HFGenerator(model, tokenizer)))
    broken = overflowing_copy(tiny_model_path, tmp_path / "broken")
    said = []
    loaded = startup.load_for_training(
        startup.prepare(TrainConfig(model=broken, generator="vllm", load_in_4bit=False), said.append), said.append)
    assert loaded.dtype == torch.float32 and started == [torch.float32], started
    assert any("float16 is not safe" in line for line in said), said


def test_a_prompt_twice_in_one_engine_call_gets_two_different_groups(tiny_model_path):
    """vLLM seeds completion i of a request with its seed + i: one seed for a whole call gave every prompt the same
    seeds, so a prompt drawn twice in a step (or two prompts the model reads alike) got the same group twice."""
    pytest.importorskip("vllm")
    from minigrpo.generate.vllm_engine import VLLMGenerator

    tokenizer = load_tokenizer(tiny_model_path)
    policy = load_policy(TrainConfig(lora_rank=8, load_in_4bit=True), tiny_model_path, torch.float32)
    engine = VLLMGenerator.start(policy, tokenizer, lora_rank=8, max_model_len=128, seed=0, max_rows=8,
                                 gpu_memory_utilization=None, sleep=False, dtype=torch.float32)
    try:
        prompt = _prompt_ids(tokenizer, ["Write a word."])[0]
        out = engine.generate([prompt, prompt], Sampling(4, 12, 1.0))
        first, second = out.completion_ids[:4], out.completion_ids[4:]
        assert first != second, first
        resumed = VLLMGenerator(engine.llm, engine.lora, sleep=False, seed=0)  # the same seed stream, again
        assert resumed.generate([prompt, prompt], Sampling(4, 12, 1.0)).completion_ids[:4] == first
    finally:
        engine.close()


# --- the fixed-shape decoder: one state held, and reused across an episode's turns ----------------------------

def _state_bytes(decoder) -> int:
    """Bytes of every tensor the decoder keeps between rollouts, its weights aside (whatever holds them)."""
    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for name, value in vars(decoder).items():
        if name not in ("blocks", "model", "inner", "head_packed"):
            walk(value)
    return total


@pytest.fixture(scope="module")
def static_policy(tiny_model_path):
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32", bf16_base=False),
                         tiny_model_path, torch.float32).eval()
    return policy, load_tokenizer(tiny_model_path)


def test_after_an_evaluation_and_a_rollout_the_decoder_holds_one_state(static_policy):
    """The held-out evaluation's state (many rows, greedy) sat beside the training rollout's through training,
    three at most: on a T4 the difference between a llama-3.2-3b run that fits and one that runs out of memory."""
    policy, tokenizer = static_policy
    prompts = _prompt_ids(tokenizer, [f"What is {a} + {a}?" for a in range(8)])
    evaluated = HFGenerator(policy, tokenizer)
    evaluated.generate(prompts, Sampling(1, 6, temperature=0.0))  # an evaluation: 8 prompts, greedy
    evaluated.generate(prompts[:1], Sampling(2, 6))  # a training rollout: 1 prompt x 2
    alone = HFGenerator(policy, tokenizer)
    alone.generate(prompts[:1], Sampling(2, 6))
    assert _state_bytes(alone.static) > 0
    assert _state_bytes(evaluated.static) == _state_bytes(alone.static)
    assert alone.static.held_bytes() == _state_bytes(alone.static)


def test_an_episodes_turns_share_one_state(static_policy):
    """Each turn of an episode has its own rows, prompt width and token budget; on a card each new shape is a new
    graph capture (and was a new cache, three kept). Four turns of 2 x 2 episodes: one state, built once."""
    from minigrpo.episodes import Limits, run_episodes

    policy, tokenizer = static_policy

    class Chat:  # answers every turn, so each episode runs to max_turns
        def respond(self, message):
            return "Go on."

    generator = HFGenerator(policy, tokenizer)
    generator.eos_ids = list(range(len(tokenizer)))  # every turn one token long: none is cut, all go on
    prompts = _prompt_ids(tokenizer, ["Tell me a story.", "Count to three."])
    torch.manual_seed(0)
    episodes = run_episodes(generator, tokenizer, [], prompts, 2, Limits(max_new_tokens=6, max_turns=4,
                            max_episode_tokens=200), environments=[Chat() for _ in range(4)])
    assert all(e.turns == 4 for e in episodes), [e.turns for e in episodes]
    assert generator.static.states_built == 1, generator.static.states_built


def test_the_plan_counts_the_evaluations_decode_and_the_state_kept_through_training():
    """llama-3.2-3b on a T4 with transformers generation: the default greedy evaluation decodes 64 rows at once
    (about 5 GB of cache where a training rollout's 16 rows take 1.2, and their prefill), and the sampled one 256;
    the plan counts them, and where they cannot fit, names the flag that makes them fit."""
    from minigrpo.cli.machine import plans_for
    from minigrpo.presets import preset_shape
    from minigrpo.plan import StepMemory

    def plan(**settings):
        cfg = TrainConfig(model="llama-3.2-3b", generator="hf", load_in_4bit=True, micro_batch_size=MICRO_BATCH["gpu"],
                          **settings)  # as on the card, whatever machine plans it
        return next(iter(plans_for(cfg, "t4", None).values()))

    alone, greedy, sampled = plan(eval_before_after=False), plan(), plan(eval_every=10)
    memory = StepMemory(preset_shape("llama-3.2-3b"), 2, 8, 512)
    rows = 16  # the preset's 2 prompts x 8
    assert alone.step_gb == pytest.approx(memory.generation_gb(rows, 192, 512) + memory.training_gb(rows, 192, 512))
    assert greedy.step_gb == pytest.approx(memory.generation_gb(64, 192, 512) + memory.prefill_gb(64, 192, 64))
    assert greedy.step_gb > alone.step_gb
    # beside the decoder's dense copy of the base (5.4 GB), 64 rows' state and their prefill do not fit a T4 either
    assert alone.fits and not greedy.fits and not sampled.fits
    for plan_ in (greedy, sampled):
        assert any("--eval-prompts" in advice for advice in plan_.advice), plan_.advice


# --- the GPU check's decode-correctness stage, at a CPU's size ----------------------------------------------

def test_the_decode_correctness_check_passes_and_catches_a_stale_graph(tmp_path, monkeypatch):
    """What the GPU check asserts on a card (the captured graph decodes as the eager loop and the trainer, before
    and after an optimizer step), run on a 4-bit + LoRA model of 3 layers; with the adapter's refresh taken out,
    the checks after the step fail: they can."""
    from minigrpo.bench.decode import _policy, decode_agreement, depth_only
    from minigrpo.generate.static import StaticDecoder

    folder = depth_only("qwen-1.5b", tmp_path / "model", layers=3)
    results = decode_agreement(_policy(folder, load_in_4bit=True), rows=4, new_tokens=8)
    assert len(results) == 5 and all(ok for _, ok, _ in results), results
    monkeypatch.setattr(StaticDecoder, "refresh", lambda self: None)
    stale = decode_agreement(_policy(folder, load_in_4bit=True), rows=4, new_tokens=8)
    assert [ok for _, ok, _ in stale] == [True, True, True, False, False], stale


def test_the_decode_correctness_check_catches_a_step_that_samples_outside_the_nucleus(tmp_path, monkeypatch):
    """The top-p check of the GPU check's correctness stage can fail: a step that ignored top-p draws from the
    whole vocabulary of a random model, far outside a 0.9 nucleus."""
    import dataclasses

    import minigrpo.generate.static as static
    from minigrpo.bench.decode import _policy, decode_agreement, depth_only

    real = static.sample
    monkeypatch.setattr(static, "sample", lambda logits, sampling: real(logits, dataclasses.replace(sampling, top_p=1.0)))
    folder = depth_only("smollm2-135m", tmp_path / "model", layers=2)
    results = {what: ok for what, ok, _ in decode_agreement(_policy(folder, load_in_4bit=False), rows=4,
                                                            new_tokens=16)}
    assert results["top-p sampling inside the fixed-shape step"] is False, results


# --- the doctor's sleep check, the facts of a card as stand-ins ---------------------------------------------

class _Card:
    """A card's free memory as an engine's sleep and wake change it."""

    def __init__(self, frees_gb: float):
        self.free, self.frees = 10 * 2**30, frees_gb * 2**30
        self.asleep = True  # `generate` has just put it to sleep, as every call does

    def _wake(self):
        if self.asleep:
            self.free -= self.frees
            self.asleep = False

    def _sleep(self):
        if not self.asleep:
            self.free += self.frees
            self.asleep = True

    def generate(self, prompts, sampling):
        self._wake()
        self._sleep()
        from minigrpo.generate import Rollout

        return Rollout([[1, 2]] * sampling.n, [False] * sampling.n)


@pytest.mark.parametrize("frees_gb,passes", [(4.8, True), (2.0, False), (0.0, False)])
def test_the_doctors_sleep_check_measures_an_awake_engine(monkeypatch, frees_gb, passes):
    """Read while it was already asleep, an engine that gives nothing back passed ("freed 0.00 GB"). Awake first,
    the check measures sleeping itself, against its weights and cache together: dropping the cache (2 GB) while
    the weights (3 GB) stay on the card does not pass."""
    from minigrpo.cli import doctor

    card = _Card(frees_gb)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (card.free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    check = doctor.check_sleep(card, weights_gb=3.0, cache_gb=2.0, prompt=[1, 2, 3])
    assert (check.status == doctor.OK) == passes, check
    assert f"freed {frees_gb:.2f} GB" in check.detail, check


# --- what the doctor and the engine's start say about a machine, from its facts -----------------------------

def test_expandable_segments_are_named_before_an_old_vllm_starts(monkeypatch, tiny):
    """vLLM before 0.21 asserts at start when torch's allocator has expandable segments (a common notebook
    setting): with `auto` the run generates with transformers and says why in the variable's name; with
    `--generator vllm` it stops with that line. 0.21 on handles them itself."""
    from minigrpo import startup
    from minigrpo.plan import Plan

    policy, tokenizer = tiny
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(startup, "vllm_available", lambda: True)
    monkeypatch.setattr(startup, "versions", lambda: {"vllm": "0.11.2"})
    started = []
    monkeypatch.setattr(startup.VLLMGenerator, "start", classmethod(lambda cls, *a, **kw: started.append(1)))
    plan = Plan("T4", 14.75, "float16", "", "vllm", "", 1.0, 1.0)
    said = []
    generator = startup.make_generator(TrainConfig(generator="auto"), policy, tokenizer, plan, torch.float32,
                                       said.append)
    assert isinstance(generator, HFGenerator) and not started
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line for line in said), said
    with pytest.raises(SetupError, match="expandable segments"):
        startup.make_generator(TrainConfig(generator="vllm"), policy, tokenizer, plan, torch.float32, said.append)
    monkeypatch.setattr(startup, "versions", lambda: {"vllm": "0.32.0"})
    startup.make_generator(TrainConfig(generator="vllm"), policy, tokenizer, plan, torch.float32, said.append)
    assert started == [1]


def test_the_doctor_fails_a_vllm_built_for_another_torch():
    from minigrpo.cli.doctor import FAIL, check_versions
    from minigrpo.hardware import CARDS, vllm_problem

    found = {"torch": "2.11.0", "transformers": "5.19.0", "peft": "0.21.2", "bitsandbytes": "0.50.2", "vllm": "0.11.2"}
    problem = vllm_problem("2.11.0+cu130", {"vllm": ["torch==2.9.0"]})
    vllm = check_versions(found, CARDS["t4"], problem)[-1]
    assert vllm.status == FAIL and "torch==2.9.0" in vllm.detail and "--generator hf" in vllm.detail, vllm


def test_the_gpu_check_installs_its_wheels_where_python_has_no_pip(tmp_path):
    """A GPU machine's python may lack pip: the carried wheels are then unpacked, and import from there."""
    import os
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("carried/__init__.py", "WHERE = 'carried'\n")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = tmp_path / "gpu_check.txt"
    env = {**os.environ, "STAGES": "none", "PATH": f"{bare / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "scripts/gpu_check.sh", str(out), str(wheels)], env=env, cwd=Path(__file__).parent.parent,
                   capture_output=True, text=True, timeout=120)
    report = out.read_text()
    assert "unpacked carried-1.0-py3-none-any.whl" in report and "No module named pip" not in report, report
