"""Group-relative advantages and the clipped GRPO objective: pure functions on tensors.

Shapes: P prompts, G completions per prompt, B = P x G rows, T completion tokens per row.

The named variants are settings of a few orthogonal knobs, not branches of their own:

    preset    scale_rewards  aggregation   what it is
    grpo      group          sequence      A = (r - mean_g) / std_g; mean over each completion's tokens,
                                           then over completions (DeepSeekMath)
    dr_grpo   none           constant      A = r - mean_g; sum over tokens / (B x max_new_tokens): no
                                           length or difficulty bias (Liu et al., 2025)
    dapo      group          token         mean over all tokens of the batch: long completions weigh
                                           by their length (Yu et al., 2025)
    bnpo      batch          token         std over the whole batch instead of the group
    gspo      group          sequence      importance_sampling "sequence": one ratio per completion, the
                                           geometric mean of its token ratios, clipped at 1 -/+ 3e-4/4e-4
                                           (Zheng et al., 2025)
    cispo     group          token         surrogate "cispo": the ratio itself is capped at 1 + epsilon_high
                                           (5 by default) and detached, a weight on A x log p, so clipped
                                           tokens keep their gradient (MiniMax-M1, 2025)
"""

from __future__ import annotations

import torch

TOKEN_PPO = dict(importance_sampling="token", surrogate="ppo", epsilon=0.2)
PRESETS = {
    "grpo": dict(scale_rewards="group", loss_aggregation="sequence", **TOKEN_PPO),
    "dr_grpo": dict(scale_rewards="none", loss_aggregation="constant", **TOKEN_PPO),
    "dapo": dict(scale_rewards="group", loss_aggregation="token", **TOKEN_PPO),
    "bnpo": dict(scale_rewards="batch", loss_aggregation="token", **TOKEN_PPO),
    "gspo": dict(scale_rewards="group", loss_aggregation="sequence", importance_sampling="sequence",
                 surrogate="ppo", epsilon=3e-4, epsilon_high=4e-4),
    "cispo": dict(scale_rewards="group", loss_aggregation="token", importance_sampling="token",
                  surrogate="cispo", epsilon=0.2, epsilon_high=4.0),
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
                tis_cap: float = 0.0, importance_sampling: str = "token", surrogate: str = "ppo",
                selected: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate plus beta x the k3 estimate of KL(policy || reference), over `mask`ed tokens.

    per token:  -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3
    with        ratio = exp(logps - old_logps),  k3 = exp(ref - logps) - (ref - logps) - 1

    importance_sampling "sequence" (GSPO): every token of a completion shares one ratio, the exponential of
    the mean of its tokens' log-ratios, so a completion is clipped as a whole.
    surrogate "cispo": per token -sg(min(ratio, 1 + epsilon_high)) * A * logps; the cap bounds the weight
    but never removes a token's gradient.

    With `sampler_logps` (the generating engine's own log-probs) and `tis_cap` > 0, the surrogate is
    weighted per token by min(exp(old_logps - sampler_logps), tis_cap): truncated importance sampling,
    which corrects for the small numerical gap between the engine that sampled and the trainer.
    With `selected` (e.g. the highest-entropy tokens), the surrogate counts only there; the KL and the
    normaliser still cover every masked token, so the selection scales the step rather than re-weighting it.

    aggregation "sequence": mean over each row's tokens, then over rows;
                "token":    sum over all tokens / number of tokens;
                "constant": sum over all tokens / (rows x max_tokens).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.bool()  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    log_ratio = torch.where(mask, logps - old_logps, 0)  # [B, T]
    if importance_sampling == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    elif importance_sampling != "token":
        raise ValueError(f"importance_sampling must be token or sequence, not {importance_sampling!r}")
    ratio = torch.exp(log_ratio).expand_as(logps)  # [B, T]
    if surrogate == "ppo":
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # [B, T]
        per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # [B, T]
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))  # [B, T]
    elif surrogate == "cispo":
        per_token = -ratio.clamp(max=1 + epsilon_high).detach() * adv * logps  # [B, T]
        is_clipped = ratio > 1 + epsilon_high  # [B, T]
    else:
        raise ValueError(f"surrogate must be ppo or cispo, not {surrogate!r}")
    if sampler_logps is not None and tis_cap > 0:
        tis = torch.exp(old_logps - sampler_logps).clamp(max=tis_cap)  # [B, T]
        per_token = per_token * tis.detach()  # [B, T]
    if selected is not None:
        per_token = torch.where(selected.bool(), per_token, 0)  # [B, T]
    if beta > 0 and ref_logps is not None:
        log_ref_ratio = ref_logps - logps  # [B, T]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [B, T]
        per_token = per_token + beta * kl  # [B, T]
    else:
        kl = torch.zeros_like(logps)  # [B, T]

    loss = aggregate(per_token, mask, aggregation, max_tokens)
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "kl": masked_mean(kl.detach(), mask),
        "ratio/mean": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics


def high_entropy(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The masked tokens whose entropy is in the top `quantile` share of the masked tokens' entropies
    (Wang et al., 2025: the few "forking" tokens carry most of what RL teaches).

    >>> high_entropy(torch.tensor([[0.1, 2.0, 0.5, 3.0]]), torch.tensor([[True, True, True, False]]), 0.5).tolist()
    [[False, True, True, False]]
    """
    mask = mask.bool()  # [B, T]
    values = entropy[mask].float()  # [tokens]
    if values.numel() == 0:
        return mask
    threshold = torch.quantile(values, 1 - quantile)  # a scalar
    return (entropy >= threshold) & mask  # [B, T]


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
