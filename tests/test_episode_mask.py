"""In an episode, tool results and environment text sit in the completion as context: the loss, the KL, the
importance weights and the sampler gap never count them, their gradient is exactly zero, and changing them
changes only what the model's later tokens see."""

import pytest
import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.model import load_policy, load_tokenizer, lora_parameters
from minigrpo.logprobs import token_logprobs
from minigrpo.rollout import Groups
from minigrpo.scoring import Scores
from minigrpo.update import micro_batches

CFG = TrainConfig(num_generations=2, micro_batch_size=2, beta=0.1, tis_cap=2.0, mask_truncated=False)


def groups(tokenizer, completions, masks) -> Groups:
    prompt = tokenizer("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False).input_ids
    return Groups([{"prompt": "What is 2 + 2?"}], [prompt], completions, ["", ""], [False, False],
                  [[-1.0] * len(c) for c in completions], Scores([0.0, 1.0], {}), model_masks=masks)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    torch.manual_seed(0)
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32"), tiny_model_path, torch.float32)
    with torch.no_grad():  # a visible adapter, so the policy and the reference differ
        for p in lora_parameters(policy):
            p.add_(torch.randn_like(p) * 0.02)
    return policy, load_tokenizer(tiny_model_path)


def lora_grads(policy, batch: Groups, pad_id: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The adapter's gradient of the step's loss, and each micro-batch's d loss / d log-prob."""
    mb = micro_batches(CFG, batch, pad_id, "cpu")
    policy.zero_grad(set_to_none=True)
    per_logp = []
    for c, (input_ids, attention, _), mask in zip(mb.chunks, mb.inputs, mb.masks):
        n = mask.shape[1]
        logps = token_logprobs(policy, input_ids, attention, n)  # [b, n]
        with torch.no_grad(), policy.disable_adapter():
            ref = token_logprobs(policy, input_ids, attention, n)
        logps.retain_grad()
        loss, _ = L.policy_loss(L.Objective.of(CFG), logps, logps.detach(), ref, torch.tensor([1.0, -1.0]), mask,
                                sampler_logps=mb.sampler[c, :n])
        loss.backward()
        per_logp.append(logps.grad)
    return [p.grad.clone() for p in lora_parameters(policy)], per_logp


def test_environment_tokens_have_exactly_zero_gradient(setup):
    policy, tokenizer = setup
    model_a, tool, model_b = ids(tokenizer, "Let me check."), ids(tokenizer, "\n<tool>4</tool>\n"), ids(tokenizer, "It is 4.")
    completion = model_a + tool + model_b
    mask = [True] * len(model_a) + [False] * len(tool) + [True] * len(model_b)
    _, (grad,) = lora_grads(policy, groups(tokenizer, [completion, completion], [mask, mask]), tokenizer.pad_token_id)
    env = torch.tensor(mask)[None, :].expand(2, -1) == 0  # [2, n]
    assert grad[env].abs().max().item() == 0.0, "a tool result's log-prob must not reach the loss"
    assert grad[~env].abs().min().item() > 0, "every model token carries gradient"


def test_changing_environment_text_changes_only_the_context(setup):
    policy, tokenizer = setup
    model_a, model_b = ids(tokenizer, "Let me check."), ids(tokenizer, "It is 4.")
    first, second = ids(tokenizer, "\n<tool>4</tool>\n"), ids(tokenizer, "\n<tool>9</tool>\n")
    assert len(first) == len(second)

    def grads(tool, after):  # the environment's text last (nothing reads it), or before the model's answer
        completion = model_a + tool + (model_b if after else [])
        mask = [True] * len(model_a) + [False] * len(tool) + [True] * (len(model_b) if after else 0)
        return lora_grads(policy, groups(tokenizer, [completion, completion], [mask, mask]), tokenizer.pad_token_id)[0]

    at_end = [torch.equal(a, b) for a, b in zip(grads(first, False), grads(second, False))]
    assert all(at_end), "text no model token reads changes nothing"
    in_context = [torch.equal(a, b) for a, b in zip(grads(first, True), grads(second, True))]
    assert not all(in_context), "text the model's answer reads is its context"


def test_episodes_keep_their_masks_through_filtering(setup):
    _, tokenizer = setup
    batch = groups(tokenizer, [[1, 2, 3], [4, 5]], [[True, False, True], [True, True]])
    picked = batch.select([0], 2)
    assert picked.model_masks == [[True, False, True], [True, True]]
    assert (picked + picked).model_masks == picked.model_masks * 2
    mb = micro_batches(CFG, batch, tokenizer.pad_token_id, "cpu")
    assert mb.full_mask.tolist() == [[True, False, True], [True, True, False]]
