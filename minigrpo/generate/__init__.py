"""Sampling completions: one small interface, and its implementations.

A generator takes prompt token ids (the trainer tokenizes once, so every engine sees the same tokens)
and returns G completions per prompt, grouped: rows [0, G) belong to prompt 0, and so on. After each
optimizer step the trainer calls `sync(model)` so the next rollout samples from the updated policy.

hf.py: the training model itself samples (`transformers`), through static.py's fixed-shape decoder where the
model's layout allows; vllm_engine.py: a vLLM engine in the same process, its adapter overwritten in place;
sampling.py: how a token is drawn, the settings the trainer's log-probs assume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from minigrpo.generate.sampling import Sampling

__all__ = ["Generator", "Rollout", "Sampling"]


@dataclass
class Rollout:
    completion_ids: list[list[int]]  # [B] token ids, ending with eos unless truncated
    truncated: list[bool]  # [B] hit max_new_tokens before eos
    sampler_logps: list[list[float]] | None = None  # [B] the engine's own log-probs, where it has them


class Generator(Protocol):
    # base=True: the base model alone, adapters off (the in-memory judge); generators may not offer it
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> Rollout: ...

    def sync(self, model) -> None: ...

    def release(self) -> None: ...  # what it holds only to generate goes back while the update runs

    def close(self) -> None: ...
