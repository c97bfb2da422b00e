import pytest
import torch
from transformers import AutoModelForCausalLM

from minigrpo.config import TrainConfig
from minigrpo.model import full_logprobs, load_policy, token_logprobs
from minigrpo.model import pad_batch


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
