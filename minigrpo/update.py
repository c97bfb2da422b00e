"""The policy update of one step: the completions as micro-batches of similar lengths, the log-probs held fixed (the
sampling-time policy across several passes, the reference for the KL), then the clipped loss, backward and
the optimizer, pass by pass. One micro-batch's activations at a time: memory does not grow with the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from minigrpo import loss as L
from minigrpo.config import TrainConfig
from minigrpo.adapters import adapter_swapped
from minigrpo.logprobs import pad_batch, token_logprobs, token_stats
from minigrpo.rollout import Groups


@dataclass
class MicroBatches:
    chunks: list[torch.Tensor]  # which completions each micro-batch holds (indices into the batch)
    inputs: list[tuple]  # per micro-batch: (ids [b, L], attention [b, L], completion mask [b, n])
    masks: list[torch.Tensor]  # per micro-batch [b, n]: the tokens that count
    full_mask: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B] completion lengths
    sampler: torch.Tensor | None  # [B, T] the generator's log-probs, where it reports them
    # per micro-batch, where it is one group's rows with its prompt run once: which of its rows share each sequence
    lanes: list[list[list[int]]] | None = None


def micro_batches(cfg: TrainConfig, batch: Groups, pad_id: int, device) -> MicroBatches:
    G = cfg.num_generations
    pairs = [(batch.prompt_ids[i // G], c) for i, c in enumerate(batch.completion_ids)]
    lengths = torch.tensor([len(c) for c in batch.completion_ids])  # [B]
    full_mask = torch.arange(lengths.max())[None, :] < lengths[:, None]  # [B, T]
    if cfg.mask_truncated:
        full_mask &= ~torch.tensor(batch.truncated)[:, None]  # [B, T]
    if batch.model_masks is not None:  # tool results and environment text: context only, never trained on
        full_mask &= padded(batch.model_masks, full_mask.shape).bool()  # [B, T]
    sampler = padded(batch.sampler_logps, full_mask.shape) if batch.sampler_logps is not None else None  # [B, T]
    length = lambda i: len(pairs[i][0]) + len(pairs[i][1])  # noqa: E731
    # micro-batches of similar lengths, so a short completion is not padded to the step's longest. Without
    # checkpointing they hold one group each, whose prompt then runs once and whose short completions share a
    # sequence (logprobs.completion_hidden), `micro_batch_size` sequences at a time; with it, any rows of similar
    # length, one to a sequence
    if cfg.gradient_checkpointing:
        order = sorted(range(len(pairs)), key=lambda i: (-length(i), i))
        parts = [[[i] for i in order[k:k + cfg.micro_batch_size]] for k in range(0, len(order), cfg.micro_batch_size)]
    else:
        parts = []
        for g in range(0, len(pairs), G):
            parts += packed({i: len(pairs[i][1]) for i in range(g, min(g + G, len(pairs)))}, cfg.micro_batch_size)
    # the longest first, so each later micro-batch's tensors fit in the memory the one before freed (shortest
    # first, a cpu's allocator found no freed block large enough and grew by a micro-batch's activations each time)
    parts.sort(key=lambda part: (-length(part[0][0]), part[0][0]))
    chunks = [torch.tensor([i for lane in part for i in lane]) for part in parts]
    inputs = [pad_batch([pairs[i] for i in c], pad_id, device) for c in chunks]
    masks = [full_mask[c, :m.shape[1]].to(device) & m for c, (_, _, m) in zip(chunks, inputs)]
    places = None if cfg.gradient_checkpointing else [numbered(part) for part in parts]
    return MicroBatches(chunks, inputs, masks, full_mask, lengths, sampler, places)


def packed(lengths: dict[int, int], size: int) -> list[list[list[int]]]:
    """One group's rows (row -> completion length) as micro-batches of at most `size` sequences: each as wide as
    the longest row left, its rows laid end to end in them, first fit from the longest down; a row that fits in
    none waits for the next micro-batch. A short completion then fills the room beside a longer one, where it was
    padded to its micro-batch's longest, and no micro-batch is wider than one row to a sequence made it.

    >>> packed({0: 64, 1: 30, 2: 20, 3: 50, 4: 10, 5: 3}, 2)
    [[[0], [3, 4, 5]], [[1], [2]]]
    """
    left, batches = sorted(lengths, key=lambda i: (-lengths[i], i)), []
    while left:
        width, lanes, later = lengths[left[0]], [], []
        for row in left:
            lane = next((lane for lane in lanes if sum(lengths[i] for i in lane) + lengths[row] <= width), None)
            if lane is not None:
                lane.append(row)
            elif len(lanes) < size:
                lanes.append([row])
            else:
                later.append(row)
        batches.append(lanes)
        left = later
    return batches


def numbered(part: list[list[int]]) -> list[list[int]]:
    """Lanes of rows, as lanes of the rows' places in their micro-batch (the rows laid out lane after lane).

    >>> numbered([[7], [3, 9], [4]])
    [[0], [1, 2], [3]]
    """
    starts = [sum(map(len, part[:k])) for k in range(len(part))]
    return [list(range(start, start + len(lane))) for start, lane in zip(starts, part)]


def fixed_logps(cfg: TrainConfig, model, mb: MicroBatches, reference: bool) -> list[torch.Tensor]:
    """Per micro-batch [b, n], without gradients: the current policy's, or the reference's (adapters off, or
    the --reference-adapter's weights in their place)."""
    def all_logps():
        return [token_logprobs(model, ids, att, m.shape[1], cfg.temperature, cfg.logprob_chunk_size, mask=m,
                               lanes=mb.lanes[k] if mb.lanes else None) for k, (ids, att, m) in enumerate(mb.inputs)]

    with torch.no_grad():
        if not reference:
            return all_logps()
        if getattr(model, "reference_weights", None) is not None:
            with adapter_swapped(model, model.reference_weights):
                return all_logps()
        with model.disable_adapter():
            return all_logps()


@dataclass
class Update:
    totals: dict  # loss (the last pass's), and kl, clip_frac, ratio/mean, entropy over the last pass
    grad_norm: float = 0.0  # mean over the passes
    overflows: int = 0  # float16 updates skipped while the scaler calibrates
    nonfinite: bool = False  # an update skipped for a NaN or inf
    gap_sum: float = 0.0  # sum over tokens of |trainer - sampler| log-prob, first pass
    gap_max: float = 0.0
    weight_sum: float = 0.0  # sum over tokens of the importance weight exp(trainer - sampler), uncapped, first pass
    reference_s: float = 0.0
    grad_norms: list[float] = field(default_factory=list)


def policy_update(cfg: TrainConfig, objective: L.Objective, model, mb: MicroBatches, advantages: torch.Tensor,
                  optimizer, scaler, entropy_coef: float = 0.0) -> Update:
    """num_iterations passes over the micro-batches, one optimizer step each, of the loss `objective` (bound once
    from `cfg` when the run starts); `entropy_coef` the bonus on the trained tokens' entropy this step
    (`loss.EntropyControl`)."""
    n_chunks = len(mb.chunks)
    # the sampling-time policy, kept fixed across the passes (one pass: it is the current one)
    old_logps = fixed_logps(cfg, model, mb, reference=False) if cfg.num_iterations > 1 else [None] * n_chunks
    start = time.perf_counter()
    ref_logps = fixed_logps(cfg, model, mb, reference=True) if cfg.beta > 0 else [None] * n_chunks
    update = Update(dict.fromkeys(("loss", "kl", "clip_frac", "ratio/mean", "entropy"), 0.0),
                    reference_s=time.perf_counter() - start)
    all_tokens = max(mb.full_mask.sum().item(), 1)
    # the sampler's log-probs on the trainer's footing: with top-p < 1 a sampler renormalises over its nucleus, the
    # trainer does not, so the sampling-time policy's kept mass goes back in (found in the first pass, kept after)
    on_trainer_footing = [None] * n_chunks
    for iteration in range(cfg.num_iterations):
        last = iteration == cfg.num_iterations - 1
        pass_loss, learned = 0.0, False
        for k, (c, (ids, attention, real), mask, old, ref) in enumerate(
                zip(mb.chunks, mb.inputs, mb.masks, old_logps, ref_logps)):
            n = mask.shape[1]
            top_p = cfg.top_p if mb.sampler is not None and iteration == 0 else 1.0
            # rows that scored alike (advantage 0 throughout) are measured for the metrics, never back-propagated
            learns = L.carries_gradient(objective, advantages[c], entropy_coef)
            with torch.set_grad_enabled(learns):
                logps, entropy, kept = token_stats(model, ids, attention, n, cfg.temperature, cfg.logprob_chunk_size,
                                                   with_entropy=True, entropy_grad=entropy_coef > 0, top_p=top_p,
                                                   mask=real, lanes=mb.lanes[k] if mb.lanes else None)  # [b, n]
            old = logps.detach() if old is None else old
            if mb.sampler is not None and iteration == 0:
                on_trainer_footing[k] = mb.sampler[c, :n].to(logps.device) + kept  # [b, n]
            sampler = on_trainer_footing[k]  # [b, n] or None
            selected = L.high_entropy(entropy, mask, cfg.top_entropy_quantile) if cfg.top_entropy_quantile < 1 \
                else None  # [b, n]
            loss, m = L.policy_loss(objective, logps, old, ref, advantages[c].to(logps.device), mask,
                                    sampler_logps=sampler, selected=selected, entropy=entropy,
                                    entropy_coef=entropy_coef)
            weight = L.microbatch_weight(mask, mb.full_mask, objective.aggregation)
            if learns:
                scaler.scale(loss * weight).backward()
                learned = True
            pass_loss += loss.item() * weight
            if last:  # report the last pass
                share = mask.sum().item() / all_tokens
                update.totals["entropy"] += L.masked_mean(entropy.detach(), mask) * share
                for key in ("kl", "clip_frac", "ratio/mean"):
                    update.totals[key] += m[key] * share
            if sampler is not None and iteration == 0:
                log_weight = (old - sampler)[mask]  # [tokens]: the importance weight's log, before its cap
                update.gap_sum += log_weight.abs().sum().item()
                update.weight_sum += log_weight.exp().sum().item()
                update.gap_max = max(update.gap_max, log_weight.abs().max().item()) if log_weight.numel() \
                    else update.gap_max
        if not learned:  # every group scored alike: a zero loss gives AdamW the zero gradients a backward would
            scaler.scale(sum(p.sum() for group in optimizer.param_groups for p in group["params"]) * 0.0).backward()
        grad_norm, outcome = apply_update(optimizer, scaler, cfg.max_grad_norm, pass_loss)
        update.grad_norms.append(grad_norm)
        update.overflows += outcome == "overflow"
        update.nonfinite |= outcome == "nonfinite"
        update.totals["loss"] = pass_loss  # the last pass's
    update.grad_norm = float(np.mean(update.grad_norms))
    return update


def apply_update(optimizer, scaler, max_grad_norm: float, loss: float) -> tuple[float, str]:
    """Clip and apply the accumulated gradients; returns the gradient norm and "applied", "overflow" (float16
    gradients overflowed at the scaler's scale: it lowers the scale and the update is skipped, as expected
    while it calibrates) or "nonfinite" (a NaN or inf that would poison the adapter and adam's moments: skipped,
    and counted towards --max-bad-steps)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler.unscale_(optimizer)  # a no-op without float16
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf")).item()
    if np.isfinite(norm) and np.isfinite(loss):
        scaler.step(optimizer)
        outcome = "applied"
    elif np.isfinite(loss) and scaler.is_enabled() and scaler.get_scale() >= 1:
        outcome = "overflow"
    else:
        outcome = "nonfinite"
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm, outcome


def padded(rows: list[list[float]], shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape)  # [B, T]
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:shape[1]])
    return out
