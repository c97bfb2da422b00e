"""Group-relative advantages and the clipped GRPO objective: pure functions on tensors.

Shapes: P prompts, G completions per prompt, B = P x G rows, T completion tokens per row.

The named variants are settings of two orthogonal knobs, not branches of their own:

    preset    scale_rewards  aggregation   what it is
    grpo      group          sequence      A = (r - mean_g) / std_g; mean over each completion's tokens,
                                           then over completions (DeepSeekMath)
    dr_grpo   none           constant      A = r - mean_g; sum over tokens / (B x max_new_tokens): no
                                           length or difficulty bias (Liu et al., 2025)
    dapo      group          token         mean over all tokens of the batch: long completions weigh
                                           by their length (Yu et al., 2025)
    bnpo      batch          token         std over the whole batch instead of the group
"""

from __future__ import annotations

import torch

PRESETS = {
    "grpo": dict(scale_rewards="group", loss_aggregation="sequence"),
    "dr_grpo": dict(scale_rewards="none", loss_aggregation="constant"),
    "dapo": dict(scale_rewards="group", loss_aggregation="token"),
    "bnpo": dict(scale_rewards="batch", loss_aggregation="token"),
}


def advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's std ("group"), the batch's ("batch"),
    or nothing ("none"). A group whose rewards are all equal gets advantage 0: no gradient.

    >>> advantages(torch.tensor([1., 0., 0., 1., 2., 2.]), group_size=2, scale="none").tolist()
    [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    """
    grouped = rewards.view(-1, group_size)  # [P, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [P, G]
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)  # [P, G]
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    return centered.view(-1)  # [B]


def groups_with_spread(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """True for each group whose rewards are not all equal: the only groups that carry a gradient."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > 1e-6  # [P]


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, *, epsilon: float = 0.2,
                epsilon_high: float | None = None, beta: float = 0.0, aggregation: str = "sequence",
                max_tokens: int | None = None, sampler_logps: torch.Tensor | None = None,
                tis_cap: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate plus beta x the k3 estimate of KL(policy || reference), over `mask`ed tokens.

    per token:  -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3
    with        ratio = exp(logps - old_logps),  k3 = exp(ref - logps) - (ref - logps) - 1

    With `sampler_logps` (the generating engine's own log-probs) and `tis_cap` > 0, the surrogate is
    weighted per token by min(exp(old_logps - sampler_logps), tis_cap): truncated importance sampling,
    which corrects for the small numerical gap between the engine that sampled and the trainer.

    aggregation "sequence": mean over each row's tokens, then over rows;
                "token":    sum over all tokens / number of tokens;
                "constant": sum over all tokens / (rows x max_tokens).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.bool()  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = torch.exp(logps - old_logps)  # [B, T]
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # [B, T]
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # [B, T]
    if sampler_logps is not None and tis_cap > 0:
        tis = torch.exp(old_logps - sampler_logps).clamp(max=tis_cap)  # [B, T]
        per_token = per_token * tis.detach()  # [B, T]
    if beta > 0 and ref_logps is not None:
        log_ref_ratio = ref_logps - logps  # [B, T]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [B, T]
        per_token = per_token + beta * kl  # [B, T]
    else:
        kl = torch.zeros_like(logps)  # [B, T]

    loss = aggregate(per_token, mask, aggregation, max_tokens)
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))  # [B, T]
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "kl": masked_mean(kl.detach(), mask),
        "ratio/mean": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return (torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)).item()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, max_tokens: int | None) -> torch.Tensor:
    # where, not multiply: a padded position's value may be inf, and inf * 0 is nan
    masked = torch.where(mask, per_token, 0)  # [B, T]
    if aggregation == "sequence":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if aggregation == "token":
        return masked.sum() / mask.sum().clamp(min=1)
    if aggregation == "constant":
        return masked.sum() / (mask.shape[0] * (max_tokens or mask.shape[1]))
    raise ValueError(f"aggregation must be sequence, token or constant, not {aggregation!r}")


def microbatch_weight(mask_micro: torch.Tensor, mask_batch: torch.Tensor, aggregation: str) -> float:
    """The share of the step's loss that one micro-batch carries, so that summing weighted micro-batch
    losses gives exactly the loss of the whole batch (rows for per-row means, tokens for a token mean)."""
    if aggregation == "token":
        return mask_micro.sum().item() / max(mask_batch.sum().item(), 1)
    return mask_micro.shape[0] / mask_batch.shape[0]
