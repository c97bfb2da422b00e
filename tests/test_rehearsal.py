"""The memory plan held to the code it describes: `minigrpo.rehearse` runs a step's real code at the presets' real
sizes on meta tensors and counts every live byte; each of the plan's terms must cover what was counted, and by no
more than 15%."""

import pytest
import torch

from minigrpo.generate.sampling import kept_logmass, nucleus
from minigrpo.hardware import CARDS
from minigrpo.rehearse import rehearse


@pytest.mark.parametrize("preset,card,top_p", [("qwen-1.5b", "t4", 0.9), ("qwen-1.5b", "3090", 1.0),
                                               ("qwen-3b", "t4", 0.9), ("qwen-3b", "3090", 1.0),
                                               ("llama-3.2-3b", "t4", 0.9), ("llama-3.2-3b", "3090", 1.0)])
def test_the_plan_covers_each_part_of_a_step_by_at_most_15_percent(preset, card, top_p):
    parts = rehearse(preset, CARDS[card], top_p)
    names = " ".join(p.name for p in parts)
    for what in ("weights", "LoRA", "activations", "log-prob buffers", "update", "SFT step", "dense copy",
                 "state for a training rollout", "prefill for the held-out evaluation"):
        assert what in names, names
    wrong = [f"{p.name}: counted {p.tracked_gb:.4f}, planned {p.planned_gb:.4f}" for p in parts
             if not p.tracked_gb <= p.planned_gb + 1e-3 or p.planned_gb > 1.15 * p.tracked_gb]
    assert not wrong, wrong


def test_an_evaluations_prefill_runs_a_group_of_prompts_at_a_time(monkeypatch):
    """All 64 held-out prompts in one forward (the decoder before) hold their whole cache and activations at once."""
    import minigrpo.memory as memory

    grouped = {p.name: p.tracked_gb for p in rehearse("qwen-1.5b", CARDS["t4"])}
    monkeypatch.setattr(memory, "PREFILL_TOKENS", 10**9)  # the decoder's and the plan's shape, both
    at_once = {p.name: p.tracked_gb for p in rehearse("qwen-1.5b", CARDS["t4"])}
    key = next(k for k in grouped if k.startswith("prefill for the held-out"))
    assert at_once[key] > 2.5 * grouped[key], (at_once[key], grouped[key])


def test_the_kept_mass_is_the_sorted_nucleus_mass_without_sorting():
    generator = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(64, 5000, generator=generator) * 6,  # peaked rows: nucleus inside the top k
                        torch.randn(64, 5000, generator=generator) * 0.3])  # flat rows: bisected
    targets = torch.randint(0, 5000, (128,), generator=generator)
    for top_p in (0.5, 0.9, 0.99):
        kept = ~nucleus(logits, top_p)
        kept.scatter_(-1, targets[:, None], True)
        expected = (logits.softmax(-1) * kept).sum(-1).log()
        # equal but where float32 rounding puts the boundary token (a flat row's ~2e-4 of mass) on the other side
        assert torch.allclose(kept_logmass(logits, targets, top_p), expected, atol=1e-3), top_p
        assert torch.allclose(kept_logmass(logits[:64], targets[:64], top_p), expected[:64], atol=1e-5), top_p


def test_a_micro_batch_with_nothing_to_score_still_backpropagates():
    """Every completion empty (or masked): zeros in the graph, not a TypeError from an empty list of chunks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minigrpo.logprobs import token_stats

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    ids, attention = torch.randint(0, 100, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    for n, mask in ((3, torch.zeros(2, 3, dtype=torch.bool)), (0, torch.zeros(2, 0, dtype=torch.bool))):
        stats = token_stats(model, ids, attention, n, with_entropy=True, top_p=0.9, mask=mask)
        assert stats.logps.shape == (2, n) and not stats.logps.any()
        stats.logps.sum().backward()  # the loss of such a micro-batch: zero gradient, no error
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
