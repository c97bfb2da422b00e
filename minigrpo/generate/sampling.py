"""How a token is drawn: the settings the trainer's log-probs assume (temperature, top-p), and the draw itself.

Every generator that samples with our own code (the transformers decode loops) draws through `sample`, so the
distribution a token came from is the one `logprobs.py` computes its log-prob under. Where top-p < 1, a sampler's
log-probs (ours, and vLLM's "processed" ones) are renormalised over the nucleus while the trainer's cover the
whole vocabulary; `kept_logmass` is what puts the two on one footing for the importance weights (update.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minigrpo.memory import NUCLEUS_TOP_K


@dataclass
class Sampling:
    n: int  # completions per prompt (G)
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    # the longest context (prompt and all that follows) later calls of the same rollout may reach: an episode's
    # turns. A fixed-shape decoder sizes its cache for it once instead of once per turn; None: this call alone
    context_tokens: int | None = None


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True outside the top-p nucleus: the most likely tokens are kept until their mass reaches top_p (the
    first token always). logits: [b, V] -> [b, V]."""
    probs, order = logits.softmax(-1).sort(-1, descending=True)  # [b, V]
    outside = probs.cumsum(-1) - probs > top_p  # [b, V]: the mass before this token already covers top_p
    return outside.scatter(-1, order, outside)  # [b, V], back in vocabulary order


def sample(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature) restricted to the top-p nucleus (greedy at
    temperature 0), and its log-prob under that distribution. logits: [b, V] -> [b], [b].

    The draw is an exponential race, argmax(p / E) with E ~ Exponential(1) per token, which picks token i with
    probability p_i exactly: no cumulative sum, whose rounding (a parallel scan on a card) can step over a
    masked token, so a token outside the nucleus (p = 0) is never drawn, and no shape that depends on values
    (it runs inside a captured CUDA graph). E is drawn as -log U: on a cpu torch's uniform draw is vectorised and
    its exponential one is not, 3 ms against 15 ms a token at 16 rows of a 49,152-token vocabulary (docs/speed.md)."""
    if sampling.temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature  # [b, V]
    if sampling.top_p < 1.0:
        logits = logits.masked_fill(nucleus(logits, sampling.top_p), float("-inf"))  # [b, V]
    logp = logits.log_softmax(-1)  # [b, V]
    # [b, V]: Exponential(1). U is never 0 (a kept token's score would be 0, a masked one's, and a one-token
    # nucleus's draw then any token) and below 1, so E is finite and above 0
    race = torch.rand_like(logp).clamp_(min=torch.finfo(logp.dtype).tiny).log_().neg_()
    token = (logp.exp() / race).argmax(-1)  # [b]: a masked token's score is exactly 0, a kept one's above 0
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def kept_logmass(logits: torch.Tensor, targets: torch.Tensor, top_p: float,
                 normalizer: torch.Tensor | None = None) -> torch.Tensor:
    """log of the probability mass top-p sampling keeps at each position, the sampled token always counted
    (where rounding put it just outside this side's nucleus, the other side's sampler still kept it).
    A sampler's nucleus log-prob plus this is the token's log-prob over the whole vocabulary, the trainer's
    footing. logits: [c, V] (already divided by the temperature), targets: [c], normalizer: their logsumexp
    [c] where the caller has it -> [c].

    No sort of the vocabulary (a float and an int64 index per entry, and a slow kernel at 150K entries): the
    nucleus is found among each row's `NUCLEUS_TOP_K` most likely tokens, and a row whose nucleus is wider
    than that has its threshold bisected over its full row. Beside `logits`, a few [c, k] tensors and, for
    bisected rows only, two [rows, V] floats and a mask (`memory.LOGPROB_BYTES` counts them). The kept set is
    `nucleus`'s, ties aside.

    >>> logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    >>> [round(kept_logmass(logits, torch.tensor([t]), 0.7).exp().item(), 4) for t in (0, 2)]
    [0.8, 1.0]
    >>> wide = -torch.arange(1000.0)[None] / 1000  # a nucleus of about 900 tokens, past the top k: bisected
    >>> sorted_mass = (wide.softmax(-1) * ~nucleus(wide, 0.9)).sum().item()
    >>> abs(kept_logmass(wide, torch.tensor([0]), 0.9).exp().item() - sorted_mass) < 1e-6
    True
    """
    if top_p >= 1.0:
        return logits.new_zeros(len(targets))  # [c]
    logits = logits.float()
    if normalizer is None:
        normalizer = torch.logsumexp(logits, dim=-1)  # [c]
    k = min(NUCLEUS_TOP_K, logits.shape[-1])
    top = (logits.topk(k, dim=-1, sorted=True).values - normalizer[:, None]).exp()  # [c, k] largest first
    ahead = top.cumsum(-1) - top  # [c, k]: the mass of the tokens ranked before each
    kept = (top * (ahead <= top_p)).sum(-1)  # [c]
    threshold = top.masked_fill(ahead > top_p, 2.0).amin(-1)  # [c]: the least likely kept token's probability
    wide = ahead[:, -1] <= top_p  # [c]: the k-th token is still kept, so the nucleus may go on past it
    if bool(wide.any()):  # rare; a host read per chunk of the update
        rows = wide.nonzero().squeeze(-1)  # [r]
        kept[rows], threshold[rows] = _bisected((logits[rows] - normalizer[rows, None]).exp_(), top_p)
    target_p = (logits.gather(-1, targets[:, None]).squeeze(-1) - normalizer).exp()  # [c]
    return (kept + target_p * (target_p < threshold)).log()  # [c]: the sampled token counted where it was out


def _bisected(probs: torch.Tensor, top_p: float, steps: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept mass and threshold of rows too wide for the top k: a token is kept where the mass strictly more
    likely than it is at most top_p, so the threshold is the least t with mass(p > t) <= top_p. probs: [r, V]."""
    low, high = probs.new_zeros(len(probs)), probs.amax(-1)  # [r]: mass(p > low) > top_p >= mass(p > high)
    for _ in range(steps):
        middle = (low + high) / 2  # [r]
        above = (probs * (probs > middle[:, None])).sum(-1) <= top_p  # [r]
        low, high = torch.where(above, low, middle), torch.where(above, middle, high)
    return (probs * (probs > low[:, None])).sum(-1), high  # [r], [r]
