"""Per-token log-probs of completions, lean in memory and in arithmetic: the stage every update pass runs.

The full-vocabulary logits are never held for the whole batch. Only the completion's real tokens go through the
lm head (a padded position's log-prob is never read, and at a quick start's lengths a third of the positions
are padding), `chunk_size` tokens at a time. For a frozen head, the usual case, `HeadLogprobs` computes a
chunk's log-probs and entropies and keeps only its hidden states and normalisers: backward recomputes the logits
once and writes the gradient into that one buffer in place, where autograd's own graph of the same steps holds
the logits, the gather's and the logsumexp's gradients and their sum, [c, V] each, and recomputes the entropy
it does not need. Any other head (one that trains, or is not a plain linear layer) has each chunk checkpointed.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minigrpo.generate.sampling import kept_logmass
from minigrpo.model import cache_keyword, checkpointing


class TokenStats(NamedTuple):
    logps: torch.Tensor  # [B, T] log-probs of the completion tokens over the whole vocabulary
    entropy: torch.Tensor  # [B, T] the policy's entropy at each position (zeros unless asked for)
    kept: torch.Tensor  # [B, T] log of the mass top-p sampling keeps there (zeros at top_p 1): sampling.kept_logmass


def token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                temperature: float = 1.0, chunk_size: int = 512, *, with_entropy: bool = False,
                entropy_grad: bool = False, top_p: float = 1.0, mask: torch.Tensor | None = None,
                lanes: list[list[int]] | None = None) -> TokenStats:
    """Log-probs of the last `n_completion` tokens of each row, under `model`, at `temperature`; with
    `with_entropy`, the policy's entropy at each of those positions (detached, unless `entropy_grad`, for a loss
    with an entropy bonus); with `top_p` < 1, the log of the mass a top-p sampler keeps there (no gradient), to put
    a sampler's nucleus log-probs on this side's footing. With `mask` [B, T], only the positions it marks are
    computed; the others read 0 (and carry no gradient). With `lanes`, every row holds the same prompt (one
    group's completions): `completion_hidden` runs it once, and the rows each lane names end to end."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    B, L = input_ids.shape
    hidden = completion_hidden(inner, input_ids, attention_mask, n_completion, lanes)  # [B, T, H]
    hidden = hidden.reshape(B * n_completion, hidden.shape[-1])  # [B*T, H]: row t predicts token t
    targets = input_ids[:, L - n_completion:].reshape(-1)  # [B*T]
    where = None if mask is None else mask.reshape(-1).nonzero().squeeze(-1)  # [N] the positions computed
    if where is not None:
        hidden, targets = hidden[where], targets[where]  # [N, H], [N]
    head = inner.get_output_embeddings()
    frozen = type(head) is torch.nn.Linear and not head.weight.requires_grad
    parts = []
    for start in range(0, len(targets), chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]  # [c, H], [c]
        if frozen:
            parts.append(HeadLogprobs.apply(h, head.weight, head.bias, t, temperature, with_entropy, entropy_grad,
                                            top_p))
        elif torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, head, h, t, temperature, with_entropy, entropy_grad, top_p,
                                    use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, temperature, with_entropy, top_p=top_p))
    columns = [torch.cat(column) for column in zip(*parts)]  # [N] each: logps, entropies, kept mass
    if not parts:  # nothing to score (every completion empty): zeros, still in the graph, so backward runs
        nothing = hidden[:, :1].sum(-1).float()  # [0]
        columns = [nothing, nothing.detach(), nothing.detach()]
    if where is not None:  # back to every position, 0 where the mask is off
        columns = [c.new_zeros(B * n_completion).index_put((where,), c) for c in columns]  # [B*T] each
    return TokenStats(*(c.view(B, n_completion) for c in columns))  # [B, T] each


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                   temperature: float = 1.0, chunk_size: int = 512, with_entropy: bool = False,
                   entropy_grad: bool = False, mask: torch.Tensor | None = None, lanes: list[list[int]] | None = None):
    """`token_stats`'s log-probs [B, T] (with `with_entropy`, and its entropies: a pair)."""
    stats = token_stats(model, input_ids, attention_mask, n_completion, temperature, chunk_size,
                        with_entropy=with_entropy, entropy_grad=entropy_grad, mask=mask, lanes=lanes)
    return (stats.logps, stats.entropy) if with_entropy else stats.logps


def completion_hidden(inner, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                      lanes: list[list[int]] | None = None) -> torch.Tensor:
    """The last hidden states [B, T, H] that predict each row's last `n_completion` tokens (row t predicts token t).

    With `lanes` (every row the same prompt, so none is padded on the left), the prompt runs once, as one row, and
    its keys and values are repeated for every lane: a lane holds the completions of the rows it names end to end,
    each attending to the prompt and to its own tokens only (`packed`). A group's completions then cost their own
    tokens, where each row would otherwise carry the prompt through every projection, forward and backward (at the
    `bench trl` setting's lengths, about a third of the update's tokens), and short ones share a lane instead of
    each being padded to the longest (a tenth of the rest). Gradients reach the prompt's pass through the repeated
    cache, summed over the lanes, as they would be over the rows' own copies. Under gradient checkpointing a layer
    drops its cache, so there every row carries its prompt, one to a row."""
    B, L = input_ids.shape
    start = L - n_completion - 1  # the prompt's last token predicts the completion's first
    if lanes is not None and start > 0 and not checkpointing(inner):
        from transformers import DynamicCache

        decoder = inner.model
        cache = {cache_keyword(decoder): DynamicCache(config=inner.config)}
        decoder(input_ids=input_ids[:1, :start], use_cache=True, **cache)  # [1, Lp - 1]: the prompt, once
        next(iter(cache.values())).batch_repeat_interleave(len(lanes))
        lengths = attention_mask[:, L - n_completion:].sum(-1).tolist()  # [B]: each row's completion tokens
        ids, places, mask, where = packed(input_ids[:, start:L - 1], lengths, lanes, start,
                                          decoder.embed_tokens.weight.dtype)
        hidden = decoder(input_ids=ids, position_ids=places, attention_mask=mask, use_cache=True,
                         **cache).last_hidden_state  # [lanes, W, H]
        return hidden.flatten(0, 1)[where]  # [B, T, H]
    hidden = inner.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=positions(attention_mask)).last_hidden_state  # [B, L, H]
    return hidden[:, start:L - 1]  # [B, T, H]


def packed(inputs: torch.Tensor, lengths: list[int], lanes: list[list[int]], start: int, dtype: torch.dtype):
    """Rows' inputs [B, T] (each the prompt's last token and its completion but the last), laid end to end in
    lanes, after a shared prompt of `start` tokens: the lanes' token ids [l, W], their positions [l, W], the
    attention mask [l, 1, W, start + W] (0 where a token may look, the dtype's least value where not: the prompt
    and the earlier tokens of its own row; a lane's padding, the prompt only), and where each row's positions
    landed in the lanes' flattened [l W] (padding points at 0) [B, T].

    >>> ids, places, mask, where = packed(torch.tensor([[5, 6, 7], [5, 8, 0]]), [3, 2], [[0, 1]], 4, torch.float32)
    >>> ids.tolist(), places.tolist(), where.tolist()
    ([[5, 6, 7, 5, 8]], [[4, 5, 6, 4, 5]], [[0, 1, 2], [3, 4, 0]])
    >>> ["".join(".x"[seen] for seen in row) for row in (mask[0, 0] == 0).tolist()]  # 4 prompt columns, then 5
    ['xxxxx....', 'xxxxxx...', 'xxxxxxx..', 'xxxx...x.', 'xxxx...xx']
    """
    B, T = inputs.shape
    W = max(sum(lengths[r] for r in lane) for lane in lanes)
    ids = inputs[:1, :1].expand(len(lanes), W).clone()  # [l, W]: padding reads the prompt's last token
    places = torch.full((len(lanes), W), start, dtype=torch.long, device=inputs.device)  # [l, W]
    row_of = torch.full((len(lanes), W), -1, dtype=torch.long, device=inputs.device)  # [l, W]: -1 for padding
    where = torch.zeros(B, T, dtype=torch.long, device=inputs.device)  # [B, T]
    for lane, rows in enumerate(lanes):
        at = 0
        for r in rows:
            n = lengths[r]
            ids[lane, at:at + n] = inputs[r, :n]
            places[lane, at:at + n] = start + torch.arange(n)
            row_of[lane, at:at + n] = r
            where[r, :n] = lane * W + at + torch.arange(n)
            at += n
    same_row = (row_of[:, :, None] == row_of[:, None, :]) & (row_of[:, None, :] >= 0)  # [l, W, W]
    seen = same_row & torch.ones(W, W, dtype=torch.bool, device=inputs.device).tril()  # [l, W, W]
    sees = torch.cat([seen.new_ones(len(lanes), W, start), seen], dim=-1)  # [l, W, start + W]
    mask = torch.zeros(sees.shape, dtype=dtype, device=inputs.device).masked_fill_(~sees, torch.finfo(dtype).min)
    return ids, places, mask[:, None], where  # [l, W], [l, W], [l, 1, W, start + W], [B, T]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    return F.linear(hidden, weight, bias).float().div_(temperature)  # [c, V], float32 whatever the model's dtype


class HeadLogprobs(torch.autograd.Function):
    """A frozen lm head's log-prob of each target, the entropy and top-p's kept mass at each row of `hidden`,
    with one [c, V] buffer alive in backward, two for the entropy's gradient (the module's docstring says why).
    Gradients reach `hidden` only.

    d log p_t / d z = onehot(t) - p, and d H / d z = -p * (log p + H), for the tempered logits z."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, entropy_grad, top_p):
        logits = _logits(hidden, weight, bias, temperature)  # [c, V]
        normalizer = torch.logsumexp(logits, dim=-1)  # [c]
        kept = kept_logmass(logits, targets, top_p, normalizer)  # [c]
        logq = logits.sub_(normalizer[:, None])  # [c, V]: log-probs, in place
        logp = logq.gather(-1, targets[:, None]).squeeze(-1)  # [c]
        entropy = -logq.exp().mul_(logq).sum(-1) if with_entropy else torch.zeros_like(logp)  # [c]: one more [c, V]
        ctx.save_for_backward(hidden, weight, bias, targets, normalizer, entropy)
        ctx.temperature, ctx.entropy_grad = temperature, with_entropy and entropy_grad
        ctx.mark_non_differentiable(kept)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy, kept

    @staticmethod
    def backward(ctx, d_logp, d_entropy, _):
        hidden, weight, bias, targets, normalizer, entropy = ctx.saved_tensors
        logq = _logits(hidden, weight, bias, ctx.temperature).sub_(normalizer[:, None])  # [c, V]
        if ctx.entropy_grad:  # a second buffer: dH/dz needs log p beside p
            grad = logq.exp()  # [c, V]: p
            logq.add_(entropy[:, None]).mul_(grad).mul_(-d_entropy[:, None])  # [c, V]: d_entropy * dH/dz
            grad.mul_(-d_logp[:, None]).add_(logq)  # [c, V]
        else:
            grad = logq.exp_().mul_(-d_logp[:, None])  # [c, V]: -d_logp * p, in the same buffer
        grad.scatter_add_(-1, targets[:, None], d_logp[:, None])  # [c, V]: the target's onehot
        grad.div_(ctx.temperature)  # through z = logits / temperature
        d_hidden = grad.to(weight.dtype) @ weight  # [c, H]
        return d_hidden.to(hidden.dtype), None, None, None, None, None, None, None


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool = False, top_p: float = 1.0):
    """A chunk's log-probs, entropies and kept mass through any head, by autograd (checkpointed by the caller)."""
    logits = head(hidden).float() / temperature  # [c, V]
    normalizer = torch.logsumexp(logits, dim=-1)  # [c]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer  # [c]
    entropy = torch.zeros_like(logp)  # [c]
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            probs = torch.softmax(logits, dim=-1)  # [c, V]
            entropy = normalizer - (probs * logits).sum(-1)  # [c]: H = logsumexp - E_p[logit]
    with torch.no_grad():
        kept = kept_logmass(logits, targets, top_p, normalizer)  # [c]
    return logp, entropy, kept


def pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Prompts padded on the left and completions on the right, so all completions start at one column.

    Returns input ids [b, Lp + T], attention mask [b, Lp + T], and the completion mask [b, T]."""
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids, attention, mask = [], [], []
    for p, c in rows:
        left, right = width_p - len(p), width_c - len(c)
        ids.append([pad_id] * left + p + c + [pad_id] * right)
        attention.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        mask.append([1] * len(c) + [0] * right)
    as_tensor = lambda x: torch.tensor(x, device=device)  # noqa: E731
    return as_tensor(ids), as_tensor(attention), as_tensor(mask).bool()


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding, as `generate` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


def full_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                  temperature: float = 1.0) -> torch.Tensor:
    """The naive reference: one log-softmax over all logits. For tests and the memory benchmark."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=positions(attention_mask)).logits.float() / temperature  # [B, L, V]
    logps = F.log_softmax(logits[:, -n_completion - 1:-1], dim=-1)  # [B, T, V]
    return logps.gather(-1, input_ids[:, -n_completion:].unsqueeze(-1)).squeeze(-1)  # [B, T]
