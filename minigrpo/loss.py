"""Group-relative advantages and the clipped GRPO objective: pure functions on tensors.

Shapes: P prompts, G completions per prompt, B = P x G rows, T completion tokens per row.

The named variants are settings of a few orthogonal knobs (config.LOSS_PRESETS), not branches of their own:

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

from dataclasses import dataclass, fields

import torch

from minigrpo.config import (Advantage, ImportanceSampling, KlEstimator, LossAggregation, RewardAggregation,
                             ScaleRewards, Surrogate, TrainConfig, choices, or_list)



def not_one_of(kind, name: str, value) -> None:
    """Raise for a value its choice (config.py's Literal) does not allow."""
    raise ValueError(f"{name} must be {or_list(choices(kind))}, not {value!r}")


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
        not_one_of(Advantage, "estimator", estimator)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [P, G]
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)  # [P, G]
    elif scale != "none":
        not_one_of(ScaleRewards, "scale", scale)
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
        not_one_of(RewardAggregation, "reward aggregation", how)
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


def carries_gradient(objective: "Objective", advantages: torch.Tensor, entropy_coef: float = 0.0) -> bool:
    """Whether rows with these advantages [b] put anything into the gradient. Without a KL or an entropy bonus a
    row's loss is its advantage times a factor, so rows whose advantages are all 0 (a group that scored alike) give
    exactly zero, and the update skips their backward pass.

    >>> carries_gradient(Objective(), torch.zeros(4)), carries_gradient(Objective(), torch.tensor([0., 0.5]))
    (False, True)
    >>> carries_gradient(Objective(beta=0.04), torch.zeros(4)), carries_gradient(Objective(), torch.zeros(4), 0.01)
    (True, True)
    """
    return objective.beta > 0 or entropy_coef > 0 or bool(advantages.ne(0).any())  # a NaN counts: it must be seen


@dataclass(frozen=True)
class Objective:
    """The loss's fixed settings, bound once when a run starts (`Objective.of(cfg)`); each field is the config's of
    the same name (but two, in `CONFIG_NAMES`), so a new knob is a field here and one in config.py.

    >>> o = Objective.of(TrainConfig(loss="gspo", max_new_tokens=64))
    >>> o.epsilon, o.epsilon_high, o.aggregation, o.max_tokens, o.importance_sampling
    (0.0003, 0.0004, 'sequence', 64, 'sequence')
    """
    epsilon: float = 0.2  # clip range below 1
    epsilon_high: float | None = None  # above 1; None: epsilon
    beta: float = 0.0  # the KL's weight
    aggregation: LossAggregation = "sequence"  # how tokens are averaged (`aggregate`)
    max_tokens: int | None = None  # the "constant" aggregation's length
    tis_cap: float = 0.0  # truncated importance sampling's cap on the trainer/sampler ratio; 0 off
    importance_sampling: ImportanceSampling = "token"
    surrogate: Surrogate = "ppo"
    kl_estimator: KlEstimator = "k3"

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Objective":
        return cls(**{f.name: getattr(cfg, CONFIG_NAMES.get(f.name, f.name)) for f in fields(cls)})


CONFIG_NAMES = {"aggregation": "loss_aggregation", "max_tokens": "completion_tokens"}  # Objective's -> the config's


def policy_loss(objective: Objective, logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, *, sampler_logps: torch.Tensor | None = None,
                selected: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
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
    o = objective
    epsilon, epsilon_high = o.epsilon, o.epsilon if o.epsilon_high is None else o.epsilon_high
    mask = mask.bool()  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    log_ratio = torch.where(mask, logps - old_logps, 0)  # [B, T]
    if o.importance_sampling == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    elif o.importance_sampling != "token":
        not_one_of(ImportanceSampling, "importance_sampling", o.importance_sampling)
    ratio = torch.exp(log_ratio).expand_as(logps)  # [B, T]
    if o.surrogate == "ppo":
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # [B, T]
        per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # [B, T]
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))  # [B, T]
    elif o.surrogate == "cispo":
        per_token = -ratio.clamp(max=1 + epsilon_high).detach() * adv * logps  # [B, T]
        is_clipped = ratio > 1 + epsilon_high  # [B, T]
    else:
        not_one_of(Surrogate, "surrogate", o.surrogate)
    if sampler_logps is not None and o.tis_cap > 0:
        tis = torch.exp(old_logps - sampler_logps).clamp(max=o.tis_cap)  # [B, T]
        per_token = per_token * tis.detach()  # [B, T]
    if selected is not None:
        per_token = torch.where(selected.bool(), per_token, 0)  # [B, T]
    if o.beta > 0 and ref_logps is not None:
        kl = kl_estimate(ref_logps - logps, o.kl_estimator)  # [B, T]
        per_token = per_token + o.beta * kl  # [B, T]
    else:
        kl = torch.zeros_like(logps)  # [B, T]

    loss = aggregate(per_token, mask, o.aggregation, o.max_tokens)
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

    >>> {k: round(kl_estimate(torch.tensor([0.5]), k).item(), 4) for k in choices(KlEstimator)}
    {'k1': -0.5, 'k2': 0.125, 'k3': 0.1487}
    """
    if estimator == "k1":
        return -log_ref_ratio
    if estimator == "k2":
        return log_ref_ratio.pow(2) / 2
    if estimator == "k3":
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1
    not_one_of(KlEstimator, "kl_estimator", estimator)


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
    not_one_of(LossAggregation, "aggregation", aggregation)


def microbatch_weight(mask_micro: torch.Tensor, mask_batch: torch.Tensor, aggregation: str) -> float:
    """The share of the step's loss that one micro-batch carries, so that summing weighted micro-batch
    losses gives exactly the loss of the whole batch (rows for per-row means, tokens for a token mean)."""
    if aggregation == "token":
        return mask_micro.sum().item() / max(mask_batch.sum().item(), 1)
    return mask_micro.shape[0] / mask_batch.shape[0]
