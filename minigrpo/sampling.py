"""How a token is drawn: the settings the trainer's log-probs assume (temperature, top-p), and the draw itself.

Every generator that samples with our own code (the transformers decode loops) draws through `sample`, so the
distribution a token came from is the one `loss.py` computes its log-prob under.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    n: int  # completions per prompt (G)
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0


def sample(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature) restricted to the top-p nucleus (greedy at
    temperature 0), and its log-prob under that distribution. logits: [b, V] -> [b], [b]."""
    if sampling.temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    logits = logits / sampling.temperature
    if sampling.top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p
        probs, order = logits.softmax(-1).sort(-1, descending=True)  # [b, V]
        outside = probs.cumsum(-1) - probs > sampling.top_p  # the mass before this token already covers top_p
        logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(outside, float("-inf")))
    logp = logits.log_softmax(-1)  # [b, V]
    cdf = logp.exp().cumsum(-1)  # [b, V]
    u = (1 - torch.rand(len(cdf), 1, device=cdf.device)) * cdf[:, -1:]  # (0, total]: never a zero-mass token
    token = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[1] - 1)  # [b]
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
