"""The fixed-shape decoder (minigrpo/generate/static.py) against the eager decode loop it replaces: the same
tokens and log-probs, the trainer's log-probs, the adapter's updates seen without rebuilding anything, one host
read per CHECK_EVERY tokens, and a one-line fallback wherever it cannot run."""

import pytest
import torch

from minigrpo.bench.decode import _counts, depth_only
from minigrpo.config import TrainConfig
from minigrpo.generate import Sampling
from minigrpo.generate.hf import HFGenerator, decode
from minigrpo.model import lora_parameters, load_policy
from minigrpo.logprobs import pad_batch, token_logprobs
from minigrpo.generate.static import CHECK_EVERY, StaticDecoder


class _Pad:  # what HFGenerator reads from a tokenizer
    pad_token_id, eos_token_id = 0, 511


def _policy(folder, load_in_4bit: bool, seed: int = 0):
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=load_in_4bit, dtype="float32", bf16_base=False),
                         folder, torch.float32).eval()
    with torch.no_grad():  # a trained adapter, not the zeros a fresh one starts from
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(seed))
    return policy


@pytest.fixture(scope="module", params=["qwen-1.5b", "smollm2-135m"])  # qwen2 (q/k/v biases) and llama layouts
def depth_model(request, tmp_path_factory):
    return depth_only(request.param, tmp_path_factory.mktemp(request.param), layers=3)


PROMPTS = [list(range(10, 40)), list(range(50, 62))]  # two prompts of different lengths: left padding


@pytest.mark.parametrize("load_in_4bit,temperature,top_p", [(True, 0.0, 1.0), (False, 1.0, 1.0), (True, 0.7, 0.9)])
def test_static_decoding_gives_the_eager_loops_tokens_and_logprobs(depth_model, load_in_4bit, temperature, top_p):
    """Seeded alike, both draw the same tokens while every row is live (the eager loop draws for live rows only,
    so once a row ends the random streams part: no row ends here, eos being outside the vocabulary)."""
    policy = _policy(depth_model, load_in_4bit)
    static = StaticDecoder.build(policy)
    sampling = Sampling(4, 20, temperature, top_p)
    torch.manual_seed(3)
    eager_tokens, eager_logps = decode(policy, PROMPTS, sampling, [512], 0)
    torch.manual_seed(3)
    tokens, logps = static.decode(PROMPTS, sampling, [512], 0)
    assert tokens == eager_tokens and all(len(row) == 20 for row in tokens)
    gap = max(abs(a - b) for x, y in zip(logps, eager_logps) for a, b in zip(x, y))
    assert gap < 1e-3, gap  # float32 weights stream at half precision on a cpu (fused.pack): 1.7e-4 here


def test_a_finished_row_ends_at_its_eos_while_the_others_go_on(depth_model):
    """Greedy, with the token that row 0 produces third made the end-of-sequence token: the rows that reach it
    end there (eos kept), the rest run to the limit, as in the eager loop that drops finished rows."""
    policy = _policy(depth_model, False)
    probe, _ = decode(policy, PROMPTS, Sampling(1, 12, 0.0), [511], 0)
    eos = probe[0][2]
    eager, _ = decode(policy, PROMPTS, Sampling(2, 12, 0.0), [eos], 0)
    tokens, _ = StaticDecoder.build(policy).decode(PROMPTS, Sampling(2, 12, 0.0), [eos], 0)
    assert tokens == eager and len(tokens[0]) == probe[0].index(eos) + 1 and tokens[0][-1] == eos


def test_on_a_cpu_rows_that_end_leave_the_batch_and_the_others_keep_their_own_cache(depth_model):
    """Sampled, with the third token row 0 draws made the eos: that row ends, and from the next host read on the
    decode steps run without it (no captured graph holds a cpu's shapes), while each row that goes on still reads
    its own cache, mask and position: the trainer's log-probs of every returned completion are the sampler's, in
    this rollout and in the next one, which reuses the state whose rows the first moved."""
    policy = _policy(depth_model, False)
    static = StaticDecoder.build(policy)
    sampling = Sampling(4, 3 * CHECK_EVERY, 1.0)
    torch.manual_seed(5)
    eos = static.decode(PROMPTS, sampling, [511], 0)[0][0][2]
    rows_per_step, step = [], static._step
    static._step = lambda s, *rest: (rows_per_step.append(len(s["token"])), step(s, *rest))[1]
    lengths = {}
    for seed in (5, 6):
        torch.manual_seed(seed)
        tokens, logps = static.decode(PROMPTS, sampling, [eos], 0)
        lengths[seed] = [len(row) for row in tokens]
        rows = [(PROMPTS[i // 4], c) for i, c in enumerate(tokens)]
        ids, attention, mask = pad_batch(rows, 0, "cpu")
        with torch.no_grad():
            trainer = token_logprobs(policy, ids, attention, mask.shape[1])  # [B, T]
        gap = (trainer[mask] - torch.tensor([x for row in logps for x in row])).abs().max().item()
        assert gap < 1e-3, (seed, gap)  # half-precision weights on a cpu (fused.pack); another row's cache: far more
    assert lengths[5][0] == 3 and max(lengths[5]) == 3 * CHECK_EVERY, lengths  # the draws are the probe's until then
    assert rows_per_step[0] == 8 and min(rows_per_step) < 8, rows_per_step
    assert static.states_built == 2  # the probe's (another eos), then one for both rollouts


def test_a_decoder_reading_float32_weights_at_half_precision_reports_its_logprobs(depth_model):
    """On a cpu the fixed-shape decoder streams float32 weights at half precision (`fused.pack`): its log-probs are
    not the trainer's, so its generator hands them to the loss (which corrects for the gap) and the run's log, asked
    or not. The eager loop reads the trainer's own float32 modules: nothing to correct, nothing reported."""
    policy = _policy(depth_model, False)
    rounds = "fbgemm" in torch.backends.quantized.supported_engines  # an x86 torch: every one this project runs on
    out = HFGenerator(policy, _Pad()).generate(PROMPTS, Sampling(2, 6))
    assert (out.sampler_logps is not None) == rounds
    assert HFGenerator(policy, _Pad(), decoder="eager").generate(PROMPTS, Sampling(2, 6)).sampler_logps is None
    if rounds:
        assert [len(row) for row in out.sampler_logps] == [len(row) for row in out.completion_ids]


def test_the_samplers_logprobs_are_the_trainers_and_follow_each_optimizer_step(depth_model):
    """After each optimizer step `sync` refreshes the adapter in place: the next rollout's log-probs are the
    updated trainer's, the fused tensors are the same ones (a captured graph reads them), and no state or graph
    is rebuilt across steps of one shape (on a card: no second capture)."""
    policy = _policy(depth_model, True)
    generator = HFGenerator(policy, _Pad(), report_logprobs=True)
    static = generator.static
    assert static is not None
    tensors = [t.data_ptr() for block in static.blocks for p in block.values() if hasattr(p, "A") for t in (p.A, p.B)]
    optimizer = torch.optim.SGD(lora_parameters(policy), lr=0.5)
    for step in range(3):
        out = generator.generate(PROMPTS, Sampling(2, 10))
        rows = [(PROMPTS[i // 2], c) for i, c in enumerate(out.completion_ids)]
        ids, attention, mask = pad_batch(rows, 0, "cpu")
        with torch.no_grad():
            trainer = token_logprobs(policy, ids, attention, mask.shape[1])  # [B, T]
        gap = (trainer[mask] - torch.tensor([x for row in out.sampler_logps for x in row])).abs().max().item()
        assert gap < 1e-3, (step, gap)  # half-precision weights on a cpu (fused.pack); a stale adapter is off by far more
        policy.train()
        optimizer.zero_grad()
        token_logprobs(policy, ids, attention, mask.shape[1])[mask].sum().backward()
        optimizer.step()
        policy.eval()
        generator.sync(policy)
    assert static.states_built == 1 and static.held is not None
    assert tensors == [t.data_ptr() for block in static.blocks for p in block.values() if hasattr(p, "A")
                       for t in (p.A, p.B)]


def test_without_a_refresh_the_decoder_decodes_with_the_old_adapter(depth_model):
    """The control for the test above: the refresh is what carries an update into the decode steps (the prompt's
    prefill runs on the live model either way), so that test can fail."""
    policy = _policy(depth_model, False)
    static = StaticDecoder.build(policy)
    static.decode(PROMPTS, Sampling(1, 8, 0.0), [511], 0)
    with torch.no_grad():
        for p in lora_parameters(policy):
            p.mul_(-3.0)
    now = decode(policy, PROMPTS, Sampling(1, 8, 0.0), [511], 0)[0]
    stale, _ = static.decode(PROMPTS, Sampling(1, 8, 0.0), [511], 0)
    static.refresh()
    fresh, _ = static.decode(PROMPTS, Sampling(1, 8, 0.0), [511], 0)
    assert fresh == now and stale != now


def test_a_16_bit_base_is_read_in_place_not_copied(depth_model):
    policy = _policy(depth_model, False)
    static = StaticDecoder.build(policy)
    layer = policy.get_base_model().model.layers[0].self_attn
    fused = static.blocks[0]["qkv"].weight
    assert layer.k_proj.base_layer.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_the_host_reads_once_per_check_interval(depth_model):
    """Syncs per token, counted by the profiler (not timed): the eager loop reads every token back, the static
    one once per CHECK_EVERY tokens."""
    policy = _policy(depth_model, False)
    per_token = {}
    for path in ("eager", "static"):
        generator = HFGenerator(policy, _Pad(), decoder=path)
        generate = lambda rows, n: generator.generate([PROMPTS[0]], Sampling(rows, n))  # noqa: E731
        short, long = _counts(generate, 2, 3)["syncs"], _counts(generate, 2, 3 + 2 * CHECK_EVERY)["syncs"]
        per_token[path] = (long - short) / (2 * CHECK_EVERY)
    assert per_token["eager"] >= 1 and per_token["static"] <= 1 / CHECK_EVERY, per_token


def test_a_model_it_cannot_read_decodes_eagerly_with_one_line(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, vocab_size=512)).save_pretrained(tmp_path)
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32", bf16_base=False), str(tmp_path),
                         torch.float32)
    said = []
    generator = HFGenerator(policy, _Pad(), say=said.append)
    assert generator.static is None and len(said) == 1 and "qwen3" in said[0]
    assert len(generator.generate([PROMPTS[0]], Sampling(2, 5)).completion_ids) == 2
    with pytest.raises(ValueError, match="--decoder static cannot decode this model"):
        HFGenerator(policy, _Pad(), decoder="static")


def test_a_decode_that_fails_says_so_once_and_goes_on_eagerly(depth_model, monkeypatch):
    """Where the fixed-shape step fails at run time (a graph that cannot be captured, an op this torch lacks),
    the run says so in one line and decodes as before; with --decoder static the failure is the user's to see."""
    policy = _policy(depth_model, False)
    said = []
    generator = HFGenerator(policy, _Pad(), say=said.append)

    def broken(*args, **kwargs):
        raise RuntimeError("cannot capture this step")

    monkeypatch.setattr(StaticDecoder, "_step", broken)
    torch.manual_seed(0)
    out = generator.generate(PROMPTS, Sampling(2, 6, 0.0))
    assert out.completion_ids == decode(policy, PROMPTS, Sampling(2, 6, 0.0), [511], 0)[0]
    assert generator.static is None and len(said) == 1 and "cannot capture this step" in said[0]
    strict = HFGenerator(policy, _Pad(), decoder="static")
    with pytest.raises(RuntimeError, match="cannot capture"):
        strict.generate(PROMPTS, Sampling(2, 6))


def test_the_plan_counts_the_dense_copy_that_fixed_shape_decoding_reads():
    """With transformers generation a 4-bit base is also held as dense weights for decoding, so the plan counts
    them; where they would take over half of what the trainer leaves free, decoding goes token by token and the
    plan counts nothing (as StaticDecoder.build decides at run time)."""
    from minigrpo.hardware import card
    from minigrpo.presets import preset_shape
    from minigrpo.plan import CUDA_CONTEXT_GB, GiB, Settings, Sizes, make_plan, trainer_gb

    for model, gpu, held in (("qwen-1.5b", "t4", True), ("qwen-7b", "3090", False)):
        shape, cfg = preset_shape(model), TrainConfig(model=model, generator="hf", load_in_4bit=True)
        plan = make_plan(shape, card(gpu), Settings.of(cfg), vllm_installed=False)
        sizes, nbytes = Sizes.of(shape), 2
        extra = plan.trainer_gb - trainer_gb(sizes, cfg.lora_rank, True, nbytes) - CUDA_CONTEXT_GB
        dense = (sizes.linear + sizes.fused_lora_per_rank * cfg.lora_rank) * nbytes / GiB  # and the adapter's copy
        assert extra == pytest.approx(dense if held else 0.0), (model, extra)


def test_attention_scores_stay_float32_before_the_softmax_as_sdpa_keeps_them(depth_model):
    """In bf16 a score near 30 is off by up to 0.06 once rounded, a 6% error in its weight: the fixed-shape step
    keeps q k^T in float32 up to the softmax, as SDPA does; rounding them first (the control) is several times
    further from float32 attention over the same bf16 keys."""
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="bfloat16", bf16_base=False),
                         depth_model, torch.bfloat16).eval()
    static = StaticDecoder.build(policy)
    generator = torch.Generator().manual_seed(0)
    n, g, hd, T = 6, 3, static.head_dim, 40
    q = (torch.randn(n, g, hd, generator=generator) * 3).bfloat16()  # scores of tens
    keys_t = (torch.randn(n, hd, T, generator=generator) * 3).bfloat16()
    mask = torch.zeros(n, 1, T)
    exact = (torch.baddbmm(mask, q.float(), keys_t.float(), alpha=static.scale)).softmax(-1)  # [n, g, T]
    kept = static._scores(mask, q, keys_t).softmax(-1)
    rounded = torch.baddbmm(mask.bfloat16(), q, keys_t, alpha=static.scale).float().softmax(-1)
    assert static._scores(mask, q, keys_t).dtype == torch.float32
    assert (kept - exact).abs().max() < 1e-5 < (rounded - exact).abs().max() / 100


def test_rollouts_of_other_kinds_share_the_held_state(depth_model):
    """A judge or the reference (no adapter) and an evaluation (another temperature) between training rollouts:
    one state serves them all (on a card, each kind's graph captured once into one memory pool), where each
    switch of kind used to free the state, build a new one and capture again."""
    policy = _policy(depth_model, False)
    static = StaticDecoder.build(policy)
    for temperature, adapters in [(1.0, True), (0.0, True), (1.0, False), (1.0, True), (0.0, False)] * 2:
        static.decode(PROMPTS, Sampling(2, 6, temperature), [511], 0, adapters=adapters)
    assert static.states_built == 1


def test_on_a_cpu_the_frozen_weights_are_repacked_with_the_same_products():
    """`fused.pack` packs a float32 weight at half precision for fbgemm, whose products are F.linear's with the
    weight rounded to fp16 and nothing else rounded, and reorders a bf16 one for oneDNN (F.linear's own products);
    through either `linear` gives that product with a bias and at other row counts than the one packed for.
    Where no kernel is, pack says None and linear is F.linear itself."""
    from torch.nn import functional as F
    from minigrpo.generate.fused import linear, pack

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = pack(weight, 16)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        assert packed is not None and not isinstance(packed, torch.Tensor)
        as_fp16 = weight.half().float()
        assert not torch.equal(as_fp16, weight)  # so the check below can tell the two products apart
        for rows in (1, 16, 40):
            x = torch.randn(rows, 64, generator=g)
            torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, as_fp16, bias), rtol=1e-5, atol=1e-5)
    weight, bias = weight.bfloat16(), bias.bfloat16()
    packed = pack(weight, 16)  # None where oneDNN has no bf16 kernel (a cpu without AVX-512)
    for rows in (1, 16, 40):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
    assert torch.equal(linear(x, weight, bias, None), F.linear(x, weight, bias))


def test_the_decoder_packs_float32_weights_once_and_keeps_them(depth_model):
    """A float32 base's half-precision pack serves every row count, so it is made once and kept through rollouts
    of other row counts and through `release` (the trainer calls it before each update); the tokens stay the same."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no fbgemm")
    generator = HFGenerator(_policy(depth_model, False), _Pad())
    static = generator.static
    first_tokens = generator.generate(PROMPTS, Sampling(4, 4, 0.0)).completion_ids
    first, head = static.blocks[0]["qkv"].packed, static.head_packed
    assert first is not None and head is not None and static.packed_rows == 8
    generator.generate(PROMPTS * 8, Sampling(4, 4, 0.0))
    generator.release()
    assert static.blocks[0]["qkv"].packed is first and static.head_packed is head and static.packed_rows == 0
    assert generator.generate(PROMPTS, Sampling(4, 4, 0.0)).completion_ids == first_tokens


def test_the_decoder_reorders_bf16_weights_per_row_count_and_gives_them_back_for_the_update(depth_model):
    """bf16 projections are reordered for a rollout's row count and kept for the next rollout of that count; one of
    another count reorders them for its own; `release` drops them, and the next rollout reorders them again and
    decodes the same tokens."""
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32", bf16_base=True),
                         depth_model, torch.float32).eval()
    generator = HFGenerator(policy, _Pad())
    static = generator.static
    first_tokens = generator.generate(PROMPTS, Sampling(4, 4, 0.0)).completion_ids
    first = static.blocks[0]["qkv"].packed
    if first is None:
        pytest.skip("oneDNN has no bf16 matmul on this cpu")
    assert static.packed_rows == 8
    generator.generate(PROMPTS, Sampling(4, 4, 1.0))
    assert static.blocks[0]["qkv"].packed is first
    generator.generate(PROMPTS * 8, Sampling(4, 4, 0.0))
    assert static.packed_rows == 64 and static.blocks[0]["qkv"].packed is not first
    generator.release()
    assert all(block[name].packed is None for block in static.blocks for name in block if name not in ("norm1", "norm2"))
    assert generator.generate(PROMPTS, Sampling(4, 4, 0.0)).completion_ids == first_tokens
    assert static.packed_rows == 8
