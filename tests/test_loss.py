import pytest
import torch

from minigrpo.loss import Objective, advantages, groups_with_spread, microbatch_weight, policy_loss


def test_advantages_are_standardised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = advantages(rewards, group_size=4)
    first = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected = (first - first.mean()) / (first.std() + 1e-4)
    assert torch.allclose(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4)), "a group with equal rewards has no advantage"
    assert abs(adv[:4].sum().item()) < 1e-6


def test_advantage_scales():
    rewards = torch.tensor([2.0, 0.0, 10.0, 0.0])
    assert advantages(rewards, 2, "none").tolist() == [1.0, -1.0, 5.0, -5.0]
    by_batch = advantages(rewards, 2, "batch")
    assert torch.allclose(by_batch, torch.tensor([1.0, -1.0, 5.0, -5.0]) / (rewards.std() + 1e-4))
    with pytest.raises(ValueError):
        advantages(rewards, 2, "max")


def test_groups_with_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3])
    assert groups_with_spread(rewards, 2).tolist() == [False, True, False]


def _inputs(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logps.detach() + 0.5 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    return logps, old, ref, adv, mask


def test_zero_advantage_gives_zero_policy_gradient():
    logps, old, ref, _, mask = _inputs()
    loss, _ = policy_loss(Objective(beta=0.0), logps, old, ref, torch.zeros(3), mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logps.grad) == 0


def test_clipping_engages_beyond_epsilon():
    logps = torch.zeros(1, 4, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5, 1 / 1.1, 1 / 0.9, 1 / 0.5]]))  # ratios 1.5, 1.1, 0.9, 0.5
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(Objective(epsilon=0.2), logps, old, None, torch.tensor([1.0]), mask)
    loss.backward()
    # positive advantage: the ratio above 1.2 is clipped (no gradient), the ones inside are not,
    # and the ratio below 0.8 keeps its gradient (min picks the unclipped, lower value)
    assert logps.grad[0, 0] == 0
    assert (logps.grad[0, 1:] != 0).all()
    assert m["clip_frac"] == pytest.approx(0.25)
    logps.grad = None
    loss, m = policy_loss(Objective(epsilon=0.2), logps, old, None, torch.tensor([-1.0]), mask)
    loss.backward()
    assert logps.grad[0, 3] == 0 and (logps.grad[0, :3] != 0).all()
    assert m["clip_frac"] == pytest.approx(0.25)


def test_clip_higher_widens_only_the_upper_side():
    logps = torch.zeros(1, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.25]]))  # ratio 1.25
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, clipped = policy_loss(Objective(epsilon=0.2), logps, old, None, torch.tensor([1.0]), mask)
    _, unclipped = policy_loss(Objective(epsilon=0.2, epsilon_high=0.28), logps, old, None, torch.tensor([1.0]),
                               mask)
    assert clipped["clip_frac"] == 1.0 and unclipped["clip_frac"] == 0.0


def test_masked_tokens_do_not_count():
    logps, old, ref, adv, mask = _inputs()
    loss_a, _ = policy_loss(Objective(beta=0.1), logps, old, ref, adv, mask)
    garbage = logps.detach().clone()
    garbage[0, 3:] = 123.0  # only masked positions change
    loss_b, _ = policy_loss(Objective(beta=0.1), garbage.requires_grad_(True), old, ref, adv, mask)
    assert torch.allclose(loss_a, loss_b)
    loss_a.backward()
    assert torch.count_nonzero(logps.grad[0, 3:]) == 0


def test_kl_is_zero_when_policy_equals_reference():
    logps, old, _, adv, mask = _inputs()
    with_kl, m = policy_loss(Objective(beta=0.5), logps, old, logps.detach(), adv, mask)
    without, _ = policy_loss(Objective(beta=0.0), logps, old, None, adv, mask)
    assert m["kl"] == 0.0
    assert torch.allclose(with_kl, without)
    _, m = policy_loss(Objective(beta=0.5), logps, old, logps.detach() - 0.5, adv, mask)
    assert m["kl"] > 0


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_microbatches_add_up_to_the_whole_batch(aggregation):
    logps, old, ref, adv, mask = _inputs(B=4, T=6, seed=3)
    mask[2, 1:] = False
    kwargs = dict(beta=0.1, aggregation=aggregation, max_tokens=8)
    whole, _ = policy_loss(Objective(**kwargs), logps, old, ref, adv, mask)
    parts = 0
    for rows in (slice(0, 1), slice(1, 4)):
        loss, _ = policy_loss(Objective(**kwargs), logps[rows], old[rows], ref[rows], adv[rows], mask[rows])
        parts = parts + loss * microbatch_weight(mask[rows], mask, aggregation)
    assert torch.allclose(whole, parts)


# an independent, deliberately plain implementation of every preset: loops over rows and tokens
def reference_loss(logps, old, ref, rewards, mask, group_size, preset, epsilon, epsilon_high, beta, max_tokens):
    from minigrpo.config import LOSS_PRESETS as PRESETS

    knobs = PRESETS[preset]
    scale, aggregation = knobs["scale_rewards"], knobs["loss_aggregation"]
    B, T = logps.shape
    adv = []
    for i in range(B):
        g = i // group_size
        group = [rewards[j].item() for j in range(g * group_size, (g + 1) * group_size)]
        mean = sum(group) / len(group)
        if scale == "group":
            std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
        elif scale == "batch":
            everything = rewards.tolist()
            m = sum(everything) / len(everything)
            std = (sum((r - m) ** 2 for r in everything) / (len(everything) - 1)) ** 0.5
        else:
            std = None
        adv.append((rewards[i].item() - mean) / (std + 1e-4) if std is not None else rewards[i].item() - mean)
    row_sums, row_counts = [], []
    for i in range(B):
        total, count = 0.0, 0
        tokens = [t for t in range(T) if mask[i, t]]
        # GSPO: one ratio per completion, the geometric mean of its token ratios
        sequence_ratio = torch.exp(sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens))
        for t in tokens:
            ratio = sequence_ratio if knobs["importance_sampling"] == "sequence" else torch.exp(logps[i, t] - old[i, t])
            if knobs["surrogate"] == "cispo":  # a capped weight on A x log p, no gradient through the weight
                term = -min(ratio.item(), 1 + epsilon_high) * adv[i] * logps[i, t]
            else:
                clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
                term = -torch.min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            total, count = total + term, count + 1
        row_sums.append(total)
        row_counts.append(count)
    if aggregation == "sequence":
        return sum(s / max(c, 1) for s, c in zip(row_sums, row_counts)) / B
    if aggregation == "token":
        return sum(row_sums) / max(sum(row_counts), 1)
    return sum(row_sums) / (B * max_tokens)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_preset_matches_an_independent_implementation(preset, beta):
    from minigrpo.config import LOSS_PRESETS as PRESETS

    g = torch.Generator().manual_seed(7)
    B, T, G = 6, 7, 3
    logps = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    old = logps.detach() + 0.25 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.2])  # the second group has no spread
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    knobs = PRESETS[preset]
    adv = advantages(rewards, G, knobs["scale_rewards"])
    objective = Objective(epsilon=0.2, epsilon_high=0.28, beta=beta, aggregation=knobs["loss_aggregation"],
                          max_tokens=10, importance_sampling=knobs["importance_sampling"], surrogate=knobs["surrogate"])
    ours, _ = policy_loss(objective, logps, old, ref, adv, mask)
    (grad_ours,) = torch.autograd.grad(ours, logps)
    theirs = reference_loss(logps, old, ref, rewards, mask, G, preset, 0.2, 0.28, beta, 10)
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    assert grad_ours.abs().sum() > 0


def test_truncated_importance_sampling_weights_and_caps():
    logps = torch.zeros(1, 3, requires_grad=True)
    sampler = torch.log(torch.tensor([[0.5, 1.0, 4.0]]))  # trainer/sampler ratios 2, 1, 0.25
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _ = policy_loss(Objective(aggregation="token", tis_cap=1.5), logps, logps.detach(), None, torch.tensor([1.0]),
                          mask, sampler_logps=sampler)
    (grad,) = torch.autograd.grad(loss, logps)
    # d/dlogp of -ratio * A * w at ratio 1 is -w/3 per token, w = min(ratio, cap)
    assert torch.allclose(grad, -torch.tensor([[1.5, 1.0, 0.25]]) / 3)


def test_sequence_ratios_clip_a_completion_as_a_whole():
    """GSPO: two tokens whose ratios are 1.5 and 1/1.5 average out to a sequence ratio of 1: not clipped,
    while token-level clipping at the same range clips one of them."""
    logps = torch.zeros(1, 2, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5, 1.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, token = policy_loss(Objective(epsilon=0.2), logps, old, None, torch.tensor([1.0]), mask)
    loss, sequence = policy_loss(Objective(epsilon=0.2, importance_sampling="sequence"), logps, old, None,
                                 torch.tensor([1.0]), mask)
    assert token["clip_frac"] == 0.5 and sequence["clip_frac"] == 0.0
    assert sequence["ratio/mean"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.allclose(grad, torch.full((1, 2), -0.5))  # d(-s A)/dlogp_t = -s A / |y|, s = 1


def test_cispo_keeps_the_gradient_of_capped_tokens():
    logps = torch.zeros(1, 2, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 3.0, 1.0]]))  # ratios 3 and 1; cap 1 + 1.0 = 2
    mask = torch.ones(1, 2, dtype=torch.bool)
    ppo, _ = policy_loss(Objective(epsilon=0.2, epsilon_high=1.0, aggregation="token"), logps, old, None,
                         torch.tensor([1.0]), mask)
    (ppo_grad,) = torch.autograd.grad(ppo, logps)
    cispo, m = policy_loss(Objective(epsilon=0.2, epsilon_high=1.0, aggregation="token", surrogate="cispo"), logps,
                           old, None, torch.tensor([1.0]), mask)
    (grad,) = torch.autograd.grad(cispo, logps)
    assert ppo_grad[0, 0] == 0  # ppo drops the clipped token
    assert torch.allclose(grad, torch.tensor([[-2.0, -1.0]]) / 2) and m["clip_frac"] == 0.5


def test_entropy_selection_trains_only_the_chosen_tokens():
    from minigrpo.loss import high_entropy

    logps, _, ref, adv, mask = _inputs(B=2, T=10, seed=5)
    old = logps.detach()  # on-policy: no token is clipped
    entropy = torch.rand(2, 10, generator=torch.Generator().manual_seed(1)) * 3
    chosen = high_entropy(entropy, mask, 0.2)
    assert chosen.sum() == round(0.2 * mask.sum().item()) and not (chosen & ~mask).any()
    assert entropy[chosen].min() >= entropy[mask & ~chosen].max()
    loss, _ = policy_loss(Objective(aggregation="token"), logps, old, None, adv, mask, selected=chosen)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad[~chosen] == 0).all() and (grad[chosen] != 0).all()
    # the normaliser is every masked token: the chosen tokens' gradients are those of the full loss
    full, _ = policy_loss(Objective(aggregation="token"), logps, old, None, adv, mask)
    (full_grad,) = torch.autograd.grad(full, logps)
    assert torch.allclose(grad[chosen], full_grad[chosen])
    # the KL still covers every token
    loss, _ = policy_loss(Objective(beta=0.1, aggregation="token"), logps, old, ref, torch.zeros(2), mask,
                          selected=chosen)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad[mask] != 0).all()


def test_gspo_and_cispo_presets_bring_their_own_clip_ranges():
    from minigrpo import TrainConfig

    gspo = TrainConfig(loss="gspo")
    assert (gspo.importance_sampling, gspo.epsilon, gspo.epsilon_high) == ("sequence", 3e-4, 4e-4)
    assert TrainConfig(loss="gspo", epsilon_high=1e-3).epsilon_high == 1e-3  # a flag wins over the preset
    cispo = TrainConfig(loss="cispo")
    assert (cispo.surrogate, cispo.loss_aggregation, cispo.epsilon_high) == ("cispo", "token", 4.0)
    assert (TrainConfig().epsilon, TrainConfig().epsilon_high, TrainConfig().importance_sampling) == (0.2, 0.2, "token")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        TrainConfig(top_entropy_quantile=0.0)

