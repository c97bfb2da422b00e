"""What a run carries from step to step, as one object: the policy and its tokenizer, the generator, the
optimizer with its schedule and float16 gradient scaler, the prompt pool and the entropy control.

A step reads and advances it (`train.train_step`), a checkpoint writes all of it and a resume reads all of it back
(`checkpoint.py`), so the three name the same things and none can forget one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.generate import Generator
from minigrpo.model import lora_parameters
from minigrpo.rollout import PromptPool


@dataclass
class RunState:
    model: object  # the PEFT policy: a 4-bit (or 16-bit) base with LoRA adapters
    tokenizer: object
    generator: Generator  # samples from the policy; synced after every optimizer step
    optimizer: torch.optim.Optimizer  # AdamW over the adapter's weights
    scheduler: torch.optim.lr_scheduler.LambdaLR  # linear warmup, then constant
    scaler: torch.amp.GradScaler  # float16's loss scaling; disabled in other dtypes
    prompts: PromptPool  # the training rows in their seeded order, with the curriculum's counts
    entropy: L.EntropyControl  # the entropy bonus's coefficient, adapted step by step with a target

    @classmethod
    def start(cls, cfg: TrainConfig, model, tokenizer, generator: Generator, dtype: torch.dtype,
              train_rows: list[dict]) -> "RunState":
        """A run's state before its first step (a resume then loads a checkpoint into it)."""
        optimizer = torch.optim.AdamW(lora_parameters(model), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
        # float16 gradients underflow; the scaler multiplies the loss up and divides the gradients back down
        scaler = torch.amp.GradScaler(model.device.type, enabled=dtype == torch.float16)
        return cls(model, tokenizer, generator, optimizer, scheduler, scaler,
                   PromptPool(train_rows, cfg.seed, cfg.retire_solved), L.EntropyControl(cfg.entropy_coef,
                                                                                         cfg.entropy_target))
