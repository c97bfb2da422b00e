"""What a run carries from step to step, as one object: the policy and its tokenizer, the generator, the
optimizer with its schedule and float16 gradient scaler, the prompt pool (below) and the entropy control.

A step reads and advances it (`train.train_step`), a checkpoint writes all of it and a resume reads all of it back
(`checkpoint.py`), so the three name the same things and none can forget one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.generate import Generator
from minigrpo.model import lora_parameters


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

    def state_dict(self) -> dict:
        """Each part's state, by its field's name (a part with no state of its own, such as a disabled scaler or a
        generator with no random state, has none): what a checkpoint writes beside the adapter's weights."""
        parts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SAVED_ELSEWHERE}
        return {name: state for name, part in parts.items() if hasattr(part, "state_dict")
                for state in [part.state_dict()] if state}

    def load_state_dict(self, saved: dict) -> None:
        for name, state in saved.items():
            part = getattr(self, name)
            if hasattr(part, "load_state_dict"):  # a generator of another kind than the one that saved
                part.load_state_dict(state)


# the parts a checkpoint does not take from `RunState.state_dict`: the adapter is saved as its own files, and the
# tokenizer never changes
SAVED_ELSEWHERE = ("model", "tokenizer")


class PromptPool:
    """Rows in a seeded random order, epoch after epoch; with `retire_after` K > 0, a curriculum: a prompt
    solved by every completion on K visits in a row leaves the pool, and a prompt never solved is drawn
    less often (after m such visits it is skipped with probability m / (m + 1))."""

    def __init__(self, rows: list[dict], seed: int, retire_after: int = 0):
        if not rows:
            raise ValueError("the task has no data rows")
        self.rows, self.rng, self.retire_after = rows, random.Random(seed), retire_after
        self.order: list[int] = []
        self.solved_streak = [0] * len(rows)
        self.unsolved_visits = [0] * len(rows)
        self.retired: set[int] = set()
        self.index = {id(row): i for i, row in enumerate(rows)}

    def draw(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            if len(self.retired) == len(self.rows):
                self.retired.clear()  # everything solved: start over rather than stop
            if not self.order:
                self.order = self.rng.sample(range(len(self.rows)), len(self.rows))
            i = self.order.pop()
            if i in self.retired:
                continue
            m = self.unsolved_visits[i]
            if self.retire_after and m and self.rng.random() < m / (m + 1):
                continue
            out.append(self.rows[i])
        return out

    def record(self, rows: list[dict], totals: list[float], G: int, solved_reward: float) -> None:
        if not self.retire_after:
            return
        for g, row in enumerate(rows):
            i = self.index[id(row)]
            group = totals[g * G:(g + 1) * G]
            if all(r >= solved_reward for r in group):
                self.solved_streak[i] += 1
                if self.solved_streak[i] >= self.retire_after:
                    self.retired.add(i)
            else:
                self.solved_streak[i] = 0
            if not any(r >= solved_reward for r in group):
                self.unsolved_visits[i] += 1
            else:
                self.unsolved_visits[i] = 0

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "solved_streak": list(self.solved_streak),
                "unsolved_visits": list(self.unsolved_visits), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["solved_streak"]) != len(self.rows):
            raise ValueError("the checkpoint's prompt pool does not match this task's data")
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
        self.solved_streak, self.unsolved_visits = list(state["solved_streak"]), list(state["unsolved_visits"])
        self.retired = set(state["retired"])

    def metrics(self) -> dict:
        if not self.retire_after:
            return {}
        return {"pool/size": len(self.rows) - len(self.retired), "pool/retired": len(self.retired)}
