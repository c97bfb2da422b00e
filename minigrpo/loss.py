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

from dataclasses import dataclass

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


def advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", estimator: str = "grpo",
               eps: float = 1e-4) -> torch.Tensor:
    """Each reward against its group's baseline, divided by the group's std ("group"), the batch's ("batch"),
    or nothing ("none"). A group whose rewards are all equal gets advantage 0: no gradient.

    estimator "grpo":  r - mean of the group
              "rloo":  r - mean of the group's other G - 1 rewards (leave-one-out, Ahmadian et al., 2024),
                       which is G / (G - 1) x (r - mean)
              "maxrl": (r - mean) / mean, the group's mean success rate (MaxRL, Tajwar et al., 2026): a prompt
                       solved 1 time in 8 weighs 8 times one solved every other time; rewards are successes in
                       [0, 1], a group with none gets 0, and `scale` does not apply (the mean is its divisor)

    >>> advantages(torch.tensor([1., 0., 0., 1., 2., 2.]), group_size=2, scale="none").tolist()
    [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    >>> advantages(torch.tensor([1., 0., 0., 0.]), group_size=4, scale="none", estimator="rloo").tolist()
    [1.0, -0.3333333432674408, -0.3333333432674408, -0.3333333432674408]
    >>> advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 0.]), group_size=4, estimator="maxrl").tolist()
    [3.0, -1.0, -1.0, -1.0, 0.3333333432674408, 0.3333333432674408, 0.3333333432674408, -1.0]
    """
    grouped = rewards.view(-1, group_size)  # [P, G]
    mean = grouped.mean(dim=1, keepdim=True)  # [P, 1]
    centered = grouped - mean  # [P, G]
    if estimator == "rloo":
        centered = centered * group_size / (group_size - 1)  # [P, G]
    elif estimator == "maxrl":
        return torch.where(mean > eps, centered / mean.clamp(min=eps), 0).view(-1)  # [B]
    elif estimator != "grpo":
        raise ValueError(f"estimator must be grpo, rloo or maxrl, not {estimator!r}")
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [P, G]
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)  # [P, G]
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    return centered.view(-1)  # [B]


def combined_rewards(values: torch.Tensor, weights: torch.Tensor, group_size: int, how: str = "sum",
                     eps: float = 1e-4) -> torch.Tensor:
    """One reward per completion from K reward functions' values [K, B]: their weighted sum ("sum"), or
    ("normalize_then_sum", GDPO, Liu et al., 2026) each function's values normalised within each group first,
    so a function with a wide range does not drown one with a narrow range. The advantage is then formed from
    the result as usual.

    >>> v = torch.tensor([[10., 0., 10., 0.], [0., 1., 1., 0.]])  # a 0/10 reward and a 0/1 reward, G = 4
    >>> combined_rewards(v, torch.tensor([1., 1.]), 4).tolist()
    [10.0, 1.0, 11.0, 0.0]
    >>> [round(x, 3) + 0.0 for x in combined_rewards(v, torch.tensor([1., 1.]), 4, "normalize_then_sum").tolist()]
    [0.0, 0.0, 1.732, -1.732]
    """
    if how == "sum":
        return (weights[:, None] * values).sum(dim=0)  # [B]
    if how != "normalize_then_sum":
        raise ValueError(f"reward aggregation must be sum or normalize_then_sum, not {how!r}")
    grouped = values.view(values.shape[0], -1, group_size)  # [K, P, G]
    normal = (grouped - grouped.mean(dim=2, keepdim=True)) / (grouped.std(dim=2, keepdim=True) + eps)  # [K, P, G]
    return (weights[:, None, None] * normal).sum(dim=0).view(-1)  # [B]


def groups_with_spread(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                       eps: float = 1e-4) -> torch.Tensor:
    """True for each group that carries a gradient: its rewards are not all equal, and for "maxrl", whose divisor
    is the group's mean success, that mean is above 0 (a group of rewards at or below 0 gets advantage 0).

    >>> groups_with_spread(torch.tensor([1., 0., -1., 0., 0., 0.]), group_size=2).tolist()
    [True, True, False]
    >>> groups_with_spread(torch.tensor([1., 0., -1., 0., 0., 0.]), group_size=2, estimator="maxrl").tolist()
    [True, False, False]
    """
    grouped = rewards.view(-1, group_size)  # [P, G]
    differs = (grouped.max(dim=1).values - grouped.min(dim=1).values) > 1e-6  # [P]
    return differs & (grouped.mean(dim=1) > eps) if estimator == "maxrl" else differs  # [P]


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, *, epsilon: float = 0.2,
                epsilon_high: float | None = None, beta: float = 0.0, aggregation: str = "sequence",
                max_tokens: int | None = None, sampler_logps: torch.Tensor | None = None,
                tis_cap: float = 0.0, importance_sampling: str = "token", surrogate: str = "ppo",
                selected: torch.Tensor | None = None, kl_estimator: str = "k3", entropy: torch.Tensor | None = None,
                entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate plus beta x an estimate of KL(policy || reference), over `mask`ed tokens, minus
    entropy_coef x the mean entropy of the trained tokens.

    per token:  -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl
    with        ratio = exp(logps - old_logps), and with d = ref - logps the KL estimators (Schulman, 2020):
                k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1 (unbiased and never negative: the default)

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
        kl = kl_estimate(ref_logps - logps, kl_estimator)  # [B, T]
        per_token = per_token + beta * kl  # [B, T]
    else:
        kl = torch.zeros_like(logps)  # [B, T]

    loss = aggregate(per_token, mask, aggregation, max_tokens)
    if entropy_coef and entropy is not None:  # a bonus on the trained tokens' mean entropy, whatever the aggregation
        trained = mask if selected is None else selected.bool() & mask  # [B, T]
        loss = loss - entropy_coef * torch.where(trained, entropy, 0).sum() / trained.sum().clamp(min=1)
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "kl": masked_mean(kl.detach(), mask),
        "ratio/mean": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics


def kl_estimate(log_ref_ratio: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimates of KL(policy || reference) from d = log p_ref - log p of the sampled tokens.

    >>> [round(kl_estimate(torch.tensor([0.5]), k).item(), 4) for k in ("k1", "k2", "k3")]
    [-0.5, 0.125, 0.1487]
    """
    if estimator == "k1":
        return -log_ref_ratio
    if estimator == "k2":
        return log_ref_ratio.pow(2) / 2
    if estimator == "k3":
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1
    raise ValueError(f"kl_estimator must be k1, k2 or k3, not {estimator!r}")


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient, held fixed or, with a `target`, adapted each step as TRL's adaptive
    entropy does (Skywork-OR1): raised by `delta` while the trained tokens' mean entropy is at or below the
    target, lowered otherwise, within [0, 1]; the bonus applies only at or below the target.

    >>> control = EntropyControl(coef=0.01, target=0.5)
    >>> control.applied(), control.step(0.4), control.applied(), round(control.step(0.9), 6), control.applied()
    (0.01, 0.015, 0.015, 0.01, 0.0)
    """
    coef: float = 0.0
    target: float | None = None
    delta: float = 0.005
    last_entropy: float | None = None

    def applied(self) -> float:
        """The coefficient this step's loss uses."""
        if self.target is None or self.last_entropy is None or self.last_entropy <= self.target:
            return self.coef
        return 0.0

    def step(self, entropy: float) -> float:
        """After an optimizer step with this mean entropy: the coefficient for the next."""
        self.last_entropy = entropy
        if self.target is not None:
            change = self.delta if entropy <= self.target else -self.delta
            self.coef = min(max(self.coef + change, 0.0), 1.0)
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]


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
