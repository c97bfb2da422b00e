from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minigrpo.config import TrainConfig
from minigrpo.model import load_policy
from minigrpo.logprobs import HeadLogprobs, _chunk_logprobs, full_logprobs, pad_batch, token_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _batch(pad_id=0):
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(10, 5000, (n_p,), generator=g).tolist(), torch.randint(10, 5000, (n_c,), generator=g).tolist())
            for n_p, n_c in [(7, 9), (4, 13), (11, 3)]]  # ragged on both sides
    return pad_batch(rows, pad_id, "cpu")


@pytest.mark.parametrize("chunk", [1, 5, 128])
def test_chunked_logprobs_equal_the_full_log_softmax(model, chunk):
    ids, attention, mask = _batch()
    T = mask.shape[1]
    with torch.no_grad():
        full = full_logprobs(model, ids, attention, T, temperature=0.7)
        chunked = token_logprobs(model, ids, attention, T, temperature=0.7, chunk_size=chunk)
    assert chunked.shape == mask.shape
    assert torch.allclose(chunked[mask], full[mask], atol=1e-5)


def test_chunked_logprobs_match_the_models_own_cross_entropy(model):
    ids, attention, mask = _batch()
    T = mask.shape[1]
    with torch.no_grad():
        ours = token_logprobs(model, ids, attention, T, chunk_size=4)
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            keep = attention[row].bool()
            seq = ids[row][keep][None]  # the row alone, unpadded
            labels = seq.clone()
            labels[:, :-n] = -100  # score only the completion
            ce = model(input_ids=seq, labels=labels).loss
            assert torch.allclose(-ours[row, :n].mean(), ce, atol=1e-5)


def test_chunked_logprobs_have_the_same_gradient(model):
    ids, attention, mask = _batch()
    T = mask.shape[1]
    grads = []
    for fn in (lambda: full_logprobs(model, ids, attention, T),
               lambda: token_logprobs(model, ids, attention, T, chunk_size=4)):
        model.zero_grad()
        fn()[mask].sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-4)


@pytest.mark.parametrize("temperature, entropy_grad, top_p", [(1.0, False, 1.0), (0.7, True, 1.0), (0.9, True, 0.8)])
def test_the_frozen_heads_fused_pass_is_autograds(temperature, entropy_grad, top_p):
    """`HeadLogprobs` (the frozen head's log-probs, entropies and kept mass, with a backward of its own) gives
    autograd's values and autograd's gradient to the hidden states, for the log-prob and the entropy terms."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 16, generator=g, requires_grad=True)  # [c, H]
    weight, bias = torch.randn(50, 16, generator=g), torch.randn(50, generator=g)  # [V, H], [V]
    targets = torch.randint(0, 50, (12,), generator=g)  # [c]
    d_logp, d_entropy = torch.randn(12, generator=g), torch.randn(12, generator=g)  # [c] each
    outputs, grads = [], []
    for fused in (True, False):
        h = hidden.detach().clone().requires_grad_(True)
        if fused:
            logp, entropy, kept = HeadLogprobs.apply(h, weight, bias, targets, temperature, True, entropy_grad, top_p)
        else:
            head = lambda x: torch.nn.functional.linear(x, weight, bias)  # noqa: E731
            logp, entropy, kept = _chunk_logprobs(head, h, targets, temperature, True, entropy_grad, top_p)
        ((logp * d_logp).sum() + ((entropy * d_entropy).sum() if entropy_grad else 0)).backward()
        outputs.append(torch.stack([logp, entropy, kept]).detach())
        grads.append(h.grad)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5), (outputs[0] - outputs[1]).abs().max()
    assert torch.allclose(grads[0], grads[1], atol=1e-5), (grads[0] - grads[1]).abs().max()
    assert (outputs[0][2] < 0).any() == (top_p < 1)  # the kept mass is below one inside a nucleus only


def test_a_policys_logprobs_skip_the_padding_and_keep_their_gradient(tiny_model_path):
    """A LoRA policy's head is frozen, so its log-probs go through `HeadLogprobs`; with the completion mask only
    the real tokens are computed. Both give the naive log-softmax's values there and its adapter gradient."""
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, bf16_base=False), tiny_model_path,
                         torch.float32)
    for name, p in policy.named_parameters():  # a trained adapter's size, so A's gradients are not zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(0))
    ids, attention, mask = _batch()
    T = mask.shape[1]
    ways = {"naive": lambda: full_logprobs(policy, ids, attention, T, temperature=0.7),
            "fused": lambda: token_logprobs(policy, ids, attention, T, temperature=0.7, chunk_size=5),
            "masked": lambda: token_logprobs(policy, ids, attention, T, temperature=0.7, chunk_size=5, mask=mask)}
    values, grads = {}, {}
    for way, logprobs in ways.items():
        policy.zero_grad(set_to_none=True)
        logps = logprobs()  # [B, T]
        logps[mask].sum().backward()
        values[way] = logps.detach()
        grads[way] = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
    assert (values["masked"][~mask] == 0).all()
    for way in ("fused", "masked"):
        assert torch.allclose(values[way][mask], values["naive"][mask], atol=1e-5), way
        # summed in another order through 30 layers: 4e-5 of the gradient's norm apart, where a lost term is ~1
        assert (grads[way] - grads["naive"]).norm() < 5e-4 * grads["naive"].norm(), way


def test_4bit_lora_policy_and_reference(tiny_model_path):
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=True), tiny_model_path)
    assert any("Linear4bit" in type(m).__name__ for m in policy.modules())
    ids, attention, mask = _batch()
    T = mask.shape[1]
    for name, p in policy.named_parameters():  # move the adapter away from its zero start
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        with policy.disable_adapter():
            reference = token_logprobs(policy, ids, attention, T)
    logps = token_logprobs(policy, ids, attention, T)
    assert not torch.allclose(logps[mask], reference[mask], atol=1e-3), "disabling the adapter changes nothing"
    logps[mask].sum().backward()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in policy.named_parameters() if p.requires_grad)
    assert all(p.grad is not None for p in trainable)


def test_gradients_flow_through_4bit_layers_after_generation(tiny_model_path):
    # bitsandbytes may repack 4-bit weights for inference after an eval-mode, no-grad forward (which is
    # what generation is), after which backward no longer reaches through the base layers. Check the
    # input gradient of a 4-bit layer of the policy, after such a forward, against its dequantized weight.
    from bitsandbytes.functional import dequantize_4bit

    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=True), tiny_model_path, torch.float32)
    layer = policy.get_base_model().model.layers[0].mlp.down_proj.base_layer
    policy.eval()
    with torch.no_grad():
        policy(input_ids=torch.tensor([[1, 2, 3]]))
    policy.train()
    weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    out = layer(x)
    assert torch.allclose(out, x @ weight.t(), atol=1e-4)
    (out ** 2).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    ((x_ref @ weight.t()) ** 2).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, x_ref.grad, atol=1e-3)


def test_bf16_projections_keep_the_adapters_small_additions(tiny_model_path):
    """With `bf16_base`, the frozen projections are stored and multiplied in bfloat16 but the model stays float32,
    so a LoRA layer's addition, far below bf16's resolution of the base output, arrives whole; in an all-bfloat16
    model the same addition is mostly rounded away (the control). The adapter still gets gradients, and the
    sampler's log-probs stay close to the trainer's."""
    from minigrpo.generate import Sampling
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import Bf16Linear
    from minigrpo.health import GAP_WARNING

    def addition_error(policy):
        layer = policy.get_base_model().model.layers[0].mlp.down_proj
        x = torch.randn(4, 7, layer.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=1e-4, generator=torch.Generator().manual_seed(1))
            out = layer(x.to(policy.dtype))  # float32 with bf16 projections; bfloat16 in the control
            with policy.disable_adapter():
                base = layer(x.to(policy.dtype))
            a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
            wanted = layer.scaling["default"] * x @ a.t() @ b.t()
        return ((out.float() - base.float() - wanted).norm() / wanted.norm()).item()

    mixed = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, bf16_base=True), tiny_model_path, torch.float32)
    projections = [m for m in mixed.modules() if hasattr(m, "base_layer")]
    assert projections and all(type(m.base_layer) is Bf16Linear and m.base_layer.weight.dtype == torch.bfloat16
                               for m in projections)
    assert all(p.dtype == torch.float32 for p in mixed.parameters() if p.requires_grad)
    if Path("/proc/self/maps").exists():  # none views the checkpoint file, which would keep all of it resident
        files = [[int(end, 16) for end in line.split()[0].split("-")]
                 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(".safetensors")]
        assert not [n for n, p in mixed.named_parameters() if any(a <= p.data_ptr() < b for a, b in files)]
    all_bf16 = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False), tiny_model_path, torch.bfloat16)
    kept, lost = addition_error(mixed), addition_error(all_bf16)
    assert kept < 1e-3 and lost > 0.1, (kept, lost)

    ids, attention, mask = _batch()
    logps = token_logprobs(mixed, ids, attention, mask.shape[1])
    logps[mask].sum().backward()
    assert all(p.grad.abs().sum() > 0 for n, p in mixed.named_parameters() if "lora_B" in n)  # A's: zero while B is

    # a one-token decoding step and a whole-sequence forward round to bf16 differently now and then, so the two
    # log-probs differ a little (the loss corrects for it): less than the gap that warns of a stale sampler
    prompt = ids[0][attention[0].bool()][:7].tolist()
    torch.manual_seed(0)
    out = HFGenerator(mixed, _Pad(), report_logprobs=True).generate([prompt], Sampling(4, 16))
    gaps = []
    for completion, sampled in zip(out.completion_ids, out.sampler_logps):
        batch, att, _ = pad_batch([(prompt, completion)], 0, "cpu")
        with torch.no_grad():
            gaps += (token_logprobs(mixed, batch, att, len(completion))[0] - torch.tensor(sampled)).abs().tolist()
    assert sum(gaps) / len(gaps) < GAP_WARNING, gaps


class _Pad:  # what HFGenerator reads from a tokenizer
    pad_token_id, eos_token_id = 0, None


def test_the_loss_gets_the_samplers_logprobs_where_precision_is_reduced():
    """In float32 the eager decode loop's log-probs are the trainer's; in bf16, fp16 or with bf16 projections they
    can differ, so the generator reports its own for the loss to correct (truncated importance sampling) and log
    (the fixed-shape decoder's generator reports them itself where it rounds the weights: test_static_decode)."""
    from types import SimpleNamespace

    from minigrpo.startup import make_generator

    plan = SimpleNamespace(generator="hf")
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))
    reports = {(dtype, bf16_base): make_generator(TrainConfig(bf16_base=bf16_base, load_in_4bit=False), model,
                                                  _Pad(), plan, dtype).report_logprobs
               for dtype, bf16_base in [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]}
    assert reports == {(torch.float32, False): False, (torch.float32, True): True, (torch.bfloat16, False): True}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_groups_prompt_runs_once_and_its_rows_share_lanes_with_the_same_logprobs_and_gradient(tiny_model_path,
                                                                                                 checkpointing):
    """One group's completions share their prompt: it runs once, its keys and values repeated for every lane, and
    the rows each lane names run end to end in it, each seeing the prompt and its own tokens only. The log-probs
    and the adapter's gradient are those of each row carrying its own copy of the prompt, in a row of its own.
    Under gradient checkpointing (where a layer drops its cache) every row carries it, as before."""
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, bf16_base=False,
                                     gradient_checkpointing=checkpointing), tiny_model_path, torch.float32)
    policy.train()
    for name, p in policy.named_parameters():  # a trained adapter's size, so A's gradients are not zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 5000, (9,), generator=g).tolist()
    rows = [(prompt, torch.randint(10, 5000, (n,), generator=g).tolist()) for n in (6, 11, 3, 8, 5)]
    ids, attention, mask = pad_batch(rows, 0, "cpu")
    T = mask.shape[1]
    seen = []  # the token positions each pass through the decoder embeds
    hook = policy.get_base_model().model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    values, grads, tokens = {}, {}, {}
    layouts = {"own rows": None, "a lane each": [[0], [1], [2], [3], [4]], "shared lanes": [[1], [3, 2], [0, 4]]}
    for name, lanes in layouts.items():
        policy.zero_grad(set_to_none=True)
        seen.clear()
        logps = token_logprobs(policy, ids, attention, T, temperature=0.7, chunk_size=5, mask=mask,
                               lanes=lanes)  # [B, T]
        logps[mask].sum().backward()
        values[name], tokens[name] = logps.detach(), sum(seen)
        grads[name] = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
    hook.remove()
    for name in ("a lane each", "shared lanes"):
        assert torch.allclose(values[name][mask], values["own rows"][mask], atol=1e-5), name
        assert (grads[name] - grads["own rows"]).norm() < 5e-4 * grads["own rows"].norm(), name
    assert tokens["own rows"] == ids.numel()
    assert tokens["a lane each"] == (ids.numel() if checkpointing else len(prompt) - 1 + len(rows) * T)
    assert tokens["shared lanes"] == (ids.numel() if checkpointing else len(prompt) - 1 + 3 * 11)


def test_micro_batches_hold_one_group_each_without_checkpointing():
    from types import SimpleNamespace

    from minigrpo.update import micro_batches

    G = 4
    prompts = [[1] * 5, [2] * 3, [3] * 7]
    completions = [[9] * n for n in (3, 8, 1, 5, 2, 2, 6, 4, 7, 1, 1, 9)]
    batch = SimpleNamespace(prompt_ids=prompts, completion_ids=completions, truncated=[False] * 12,
                            model_masks=None, sampler_logps=None)  # what micro_batches reads of a rollout
    for checkpointing in (False, True):
        cfg = TrainConfig(num_generations=G, micro_batch_size=3, gradient_checkpointing=checkpointing)
        mb = micro_batches(cfg, batch, 0, "cpu")
        assert sorted(int(i) for c in mb.chunks for i in c) == list(range(12))
        longest = [max(len(prompts[int(i) // G]) + len(completions[int(i)]) for i in c) for c in mb.chunks]
        assert longest == sorted(longest, reverse=True)  # the longest first
        one_group = all(len({int(i) // G for i in c}) == 1 for c in mb.chunks)
        assert (mb.lanes is not None) == one_group == (not checkpointing)
        if mb.lanes is not None:  # a group's short completions share sequences no longer than its longest
            assert len(mb.chunks) == 3  # one micro-batch a group: 3, 3 and 2 lanes; 6 micro-batches one to a row
            for chunk, lanes in zip(mb.chunks, mb.lanes):
                widths = [sum(len(completions[int(chunk[j])]) for j in lane) for lane in lanes]
                assert len(lanes) <= 3 and max(widths) == max(len(completions[int(i)]) for i in chunk)
                assert sorted(j for lane in lanes for j in lane) == list(range(len(chunk)))


def test_checkpointing_is_read_by_the_name_this_transformers_has_without_its_warning():
    """transformers 5.2x renamed `is_gradient_checkpointing` to `is_activation_checkpointing` and made the old name
    warn (it goes in 6); the packed log-probs ask once per micro-batch, and a first run must not print that warning.
    Stand-ins of both shapes of the class: the new one, whose old name warns, and one from before the rename."""
    import warnings

    from minigrpo.model import checkpointing

    class Renamed:  # transformers 5.2x and later
        def __init__(self, on):
            self.on = on

        @property
        def is_activation_checkpointing(self):
            return self.on

        @property
        def is_gradient_checkpointing(self):
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
            return self.on

    class Before:  # 4.x and 5.x before the rename
        def __init__(self, on):
            self.is_gradient_checkpointing = on

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [checkpointing(cls(on)) for cls in (Renamed, Before) for on in (True, False)] == [True, False] * 2
        assert checkpointing(object()) is False  # a model with neither never checkpoints
