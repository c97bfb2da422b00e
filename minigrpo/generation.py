"""Sampling completions: one small interface, and the `transformers` implementation of it.

A generator takes prompt token ids (the trainer tokenizes once, so every engine sees the same tokens)
and returns G completions per prompt, grouped: rows [0, G) belong to prompt 0, and so on. After each
optimizer step the trainer calls `sync(model)` so the next rollout samples from the updated policy.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Sampling:
    n: int  # completions per prompt (G)
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0


@dataclass
class Rollout:
    completion_ids: list[list[int]]  # [B] token ids, ending with eos unless truncated
    truncated: list[bool]  # [B] hit max_new_tokens before eos
    sampler_logps: list[list[float]] | None = None  # [B] the engine's own log-probs, where it has them


class Generator(Protocol):
    # base=True: the base model alone, adapters off (the in-memory judge); generators may not offer it
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> Rollout: ...

    def sync(self, model) -> None: ...

    def close(self) -> None: ...


class HFGenerator:
    """Sampling with the training model itself, token by token: no second copy, always in sync.

    Our own decode loop rather than `model.generate`, for three reasons measured on CPU (the place this
    generator runs most): each distinct prompt is prefilled once and its cache copied to its G rows, not
    prefilled G times; a row that ends leaves the batch, so the rest compute without it; and sampling is
    one inverse-CDF draw per row rather than `torch.multinomial`'s exponential draw over the whole
    vocabulary. It samples with exactly the settings the trainer's log-probs assume (temperature, top-p,
    nothing else): the model's own `generation_config` (a repetition penalty, top-k, banned words) plays no
    part. With `report_logprobs` it returns its own log-probs of what it sampled, as the vLLM engine does
    (tests and `minigrpo doctor` compare them with the trainer's)."""

    def __init__(self, model, tokenizer, report_logprobs: bool = False):
        self.model = model
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        self.report_logprobs = report_logprobs

    def sync(self, model) -> None:
        pass  # it samples from the very model being trained

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter() if base else contextlib.nullcontext():
                tokens, logps = decode(self.model, prompt_ids, sampling, self.eos_ids, self.pad_id)
        finally:
            self.model.train(was_training)
        ended = [bool(row) and row[-1] in self.eos_ids for row in tokens]
        return Rollout(tokens, [not e for e in ended], logps if self.report_logprobs else None)


def decode(model, prompt_ids: list[list[int]], sampling: Sampling, eos_ids: list[int],
           pad_id: int) -> tuple[list[list[int]], list[list[float]]]:
    """G sampled continuations of each prompt, grouped (rows [0, G) continue prompt 0), each ending at its
    first eos token (kept: the model learns to stop) or after `max_new_tokens`; and the log-prob of each
    sampled token under the distribution it was drawn from (after temperature and top-p)."""
    from transformers import DynamicCache

    dev = model.device
    cache_arg = cache_keyword(model)
    width = max(len(ids) for ids in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=dev)  # [P, Lp]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=dev)  # [P, Lp]
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(sampling.n)  # one prefill per prompt, copied to its G rows
    logits = out.logits[:, -1].repeat_interleave(sampling.n, dim=0)  # [B, V]
    mask = mask.repeat_interleave(sampling.n, dim=0)  # [B, Lp]
    B = logits.shape[0]
    live = torch.arange(B, device=dev)  # [b]: which of the B rows are still generating
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
    for t in range(sampling.max_new_tokens):
        token, logp = sample(logits.float(), sampling)  # [b], [b]
        for row, tok, lp in zip(live.tolist(), token.tolist(), logp.tolist()):
            tokens[row].append(tok)
            logps[row].append(lp)
        going = ~torch.isin(token, eos)  # [b]
        if t == sampling.max_new_tokens - 1 or not going.any():
            break
        if not going.all():  # finished rows leave the batch and its cache
            keep = going.nonzero().squeeze(-1)
            live, token, mask = live[keep], token[keep], mask[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)  # [b, L + 1]
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    **{cache_arg: cache}, use_cache=True)
        logits = out.logits[:, -1]  # [b, V]
    return tokens, logps


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


def cache_keyword(model) -> str:
    """The name a model's forward takes its key/value cache by: `cache` from transformers 5.24 on (where the old
    `past_key_values` warns, and is to go in 5.40), `past_key_values` before."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
