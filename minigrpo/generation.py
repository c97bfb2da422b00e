"""Sampling completions: one small interface, and the `transformers` implementation of it.

A generator takes prompt token ids (the trainer tokenizes once, so every engine sees the same tokens)
and returns G completions per prompt, grouped: rows [0, G) belong to prompt 0, and so on. After each
optimizer step the trainer calls `sync(model)` so the next rollout samples from the updated policy.
"""

from __future__ import annotations

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
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout: ...

    def sync(self, model) -> None: ...

    def close(self) -> None: ...


class HFGenerator:
    """`model.generate` on the training model itself: no second copy, always in sync.

    It samples with exactly the settings the trainer's log-probs assume (temperature, top-p, nothing else):
    the model's own `generation_config` may carry a repetition penalty, top-k or banned words, and
    transformers would apply them, so the samples would not come from the policy being trained. With
    `report_logprobs` it returns its own log-probs of what it sampled, as the vLLM engine does (tests and
    `minigrpo doctor` compare them with the trainer's)."""

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
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        rows = [ids for ids in prompt_ids for _ in range(sampling.n)]  # grouped: G rows per prompt
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in rows])  # [B, Lp]
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])  # [B, Lp]
        was_training = self.model.training
        self.model.eval()
        try:
            with exact_sampling(self.model, self.eos_ids, self.pad_id):
                out = self.model.generate(
                    input_ids=input_ids.to(self.model.device), attention_mask=attention.to(self.model.device),
                    **greedy_or_sampled(sampling), max_new_tokens=sampling.max_new_tokens, use_cache=True,
                    return_dict_in_generate=True, output_scores=self.report_logprobs,
                )
        finally:
            self.model.train(was_training)
        generated = out.sequences[:, width:]  # [B, T]
        logps = None
        if self.report_logprobs:  # the processed scores: after temperature and top-p, as sampled
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [B, T, V]
            logps = scores.gather(-1, generated.unsqueeze(-1)).squeeze(-1).tolist()  # [B, T]
        completions, truncated, sampler_logps = [], [], []
        for i, row in enumerate(generated.tolist()):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            completions.append(row if end is None else row[:end + 1])  # keep eos: the model learns to stop
            truncated.append(end is None)
            if logps is not None:
                sampler_logps.append(logps[i][:len(completions[-1])])
        return Rollout(completions, truncated, sampler_logps if logps is not None else None)


class exact_sampling:
    """For the length of a `generate` call, a generation config with no settings of the model's own, so
    transformers adds no penalty, top-k, banned words or forced tokens to what we ask for."""

    def __init__(self, model, eos_ids: list[int], pad_id: int):
        from transformers import GenerationConfig

        self.inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.clean = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id,
                                      bos_token_id=getattr(self.inner.generation_config, "bos_token_id", None))

    def __enter__(self):
        self.saved = self.inner.generation_config
        self.inner.generation_config = self.clean

    def __exit__(self, *exc):
        self.inner.generation_config = self.saved


def greedy_or_sampled(sampling: Sampling) -> dict:
    if sampling.temperature == 0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
