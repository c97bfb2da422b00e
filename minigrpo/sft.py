"""A supervised warm-up before GRPO: the same 4-bit (or 16-bit) base with LoRA adapters, trained on the
completion tokens of worked examples, written as an adapter that `minigrpo train --init-adapter` starts from
(and `--reference-adapter` may take as the KL's reference).

    minigrpo sft --task warmup.jsonl --out warmup          # then: minigrpo train --init-adapter warmup/adapter

Each row is {"prompt": ..., "completion": ...} (text, or chat messages), or {"messages": [...]} whose last
message is the assistant's answer and the rest its prompt. The prompt goes through the chat template as
training renders it; the loss is the mean negative log-likelihood of the completion's tokens (and its end of
turn), nothing of the prompt. A short loop of our own: it reuses the policy loader and the chunked log-probs
of the GRPO step, so the model in memory is the one `train` builds, and nothing else is loaded.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minigrpo import settle
from minigrpo.config import TrainConfig


@dataclass
class Example:
    prompt: str | list[dict]
    completion: str


TokenRows = list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) per example


def read_examples(path: Path) -> list[Example]:
    """The data file's examples, or an error that names the line and what it lacks."""
    from minigrpo.data import prompt_problem, read_rows_and_places

    rows, places = read_rows_and_places(path, prompts=False)
    out = []
    for row, place in zip(rows, places):
        if "messages" in row and isinstance(row["messages"], list) and row["messages"]:
            *before, last = row["messages"]
            if not all(isinstance(m, dict) and "role" in m for m in row["messages"]):
                raise ValueError(f"{place}: each item of `messages` must be a message, "
                                 f"{{\"role\": ..., \"content\": ...}}")
            if last.get("role") != "assistant" or not before:
                raise ValueError(f"{place}: the last of `messages` must be the assistant's answer, after a prompt")
            out.append(Example(before, str(last.get("content", ""))))
        elif "prompt" in row and "completion" in row and not prompt_problem(row["prompt"]):
            completion = row["completion"]
            if isinstance(completion, list):  # chat-format completion: the assistant's turn
                completion = completion[-1].get("content", "")
            out.append(Example(row["prompt"], str(completion)))
        else:
            raise ValueError(f"{place}: an SFT row has `prompt` and `completion`, or `messages` (it has "
                             f"{sorted(row)})")
    if not out:
        raise ValueError(f"{path} has no examples")
    return out


def token_rows(tokenizer, examples: list[Example]) -> TokenRows:
    """(prompt ids, completion ids) per example; the completion ends as the model ends a turn."""
    from minigrpo.tools import render_prompt

    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [(tokenizer(render_prompt(tokenizer, e.prompt), add_special_tokens=False).input_ids,
             tokenizer(e.completion, add_special_tokens=False).input_ids + end) for e in examples]


def sized_for(cfg: TrainConfig, examples: list[Example], data: Path) -> tuple[TokenRows, TrainConfig]:
    """The examples as token rows, and a copy of `cfg` sized for the longest (a micro-batch pads its prompts and its
    completions to their longest): the plan's memory, the attention kind and checkpointing follow the data, not
    GRPO's lengths. An example longer than the model's context is refused with its length."""
    from transformers import AutoConfig

    from minigrpo.model import load_tokenizer
    from minigrpo.weights import resolve_weights

    weights = resolve_weights(cfg.hub_id)
    rows = token_rows(load_tokenizer(weights), examples)
    context = getattr(AutoConfig.from_pretrained(weights), "max_position_embeddings", None)
    for i, (prompt, completion) in enumerate(rows, 1):
        if context and len(prompt) + len(completion) > context:
            raise ValueError(f"{data}, example {i}: {len(prompt) + len(completion)} tokens, more than {cfg.model}'s "
                             f"context of {context}: shorten it or leave it out")
    return rows, settle.for_sft(cfg, max(len(p) for p, _ in rows), max(len(c) for _, c in rows))


def sft_step(cfg: TrainConfig, model, batch: TokenRows, pad_id: int, optimizer, scaler) -> tuple[float, int, str]:
    """One optimizer step on a micro-batch of examples: the mean NLL of their completion tokens. Returns the loss,
    the tokens it averaged over, and `update.apply_update`'s outcome ("applied", or why it was skipped)."""
    from minigrpo.logprobs import pad_batch, token_logprobs
    from minigrpo.update import apply_update

    ids, attention, mask = pad_batch(batch, pad_id, model.device)
    logps = token_logprobs(model, ids, attention, mask.shape[1], 1.0, cfg.logprob_chunk_size)  # [b, n]
    loss = -torch.where(mask, logps, 0).sum() / mask.sum()  # mean NLL of the completion tokens
    scaler.scale(loss).backward()
    value = loss.item()
    return value, int(mask.sum().item()), apply_update(optimizer, scaler, cfg.max_grad_norm, value)[1]


def sft(cfg: TrainConfig, data: Path, out: Path, epochs: int = 3, say=print) -> Path:
    """Train the adapter on `data` for `epochs` passes; write it to out/adapter and the record to out/sft.json."""
    from minigrpo.model import lora_parameters, seed_everything
    from minigrpo.run import usable_or_fail
    from minigrpo.startup import load_for_training, prepare

    examples = read_examples(Path(data))
    usable_or_fail(Path(out), "--out", may_hold_results=False)
    seed_everything(cfg.seed)
    rows, cfg = sized_for(cfg, examples, Path(data))
    prepared = prepare(cfg, say, longest_prompt=cfg.max_prompt_tokens)
    loaded = load_for_training(prepared, say, generate=False)
    model, tokenizer, cfg = loaded.model, loaded.tokenizer, prepared.cfg
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    # as in GRPO's update: float16 gradients scaled up so they do not underflow, and a step whose loss or
    # gradients are not finite skipped rather than written into the adapter and AdamW's moments
    scaler = torch.amp.GradScaler(model.device.type, enabled=loaded.dtype == torch.float16)
    skipped = {"overflow": 0, "nonfinite": 0}
    order, losses, started = list(range(len(rows))), [], time.perf_counter()
    model.train()
    for epoch in range(1, epochs + 1):
        random.Random(cfg.seed + epoch).shuffle(order)
        total, tokens = 0.0, 0
        for start in range(0, len(order), cfg.micro_batch_size):
            batch = [rows[i] for i in order[start:start + cfg.micro_batch_size]]
            loss, n, outcome = sft_step(cfg, model, batch, tokenizer.pad_token_id, optimizer, scaler)
            if outcome != "applied":
                skipped[outcome] += 1
                continue
            total, tokens = total + loss * n, tokens + n
        if not tokens:
            raise ValueError(f"every step of SFT epoch {epoch} had a loss or gradients that are not finite: this "
                             f"model overflows in {loaded.dtype}; run it with --dtype float32")
        losses.append(total / max(tokens, 1))
        say(f"epoch {epoch}/{epochs}: completion loss {losses[-1]:.3f} (mean NLL per token)")
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(Path(out) / "adapter")
    record = {"model": cfg.model, "data": str(data), "examples": len(rows), "epochs": epochs,
              "learning_rate": cfg.learning_rate, "lora_rank": cfg.lora_rank, "losses": losses,
              "longest_tokens": cfg.max_prompt_tokens + cfg.max_new_tokens,
              "gradient_checkpointing": cfg.gradient_checkpointing,
              "seconds": round(time.perf_counter() - started, 1), "dtype": str(loaded.dtype),
              "skipped_steps": skipped}
    (Path(out) / "sft.json").write_text(json.dumps(record, indent=2) + "\n")
    return Path(out) / "adapter"
