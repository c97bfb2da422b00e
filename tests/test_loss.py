import pytest
import torch

from minigrpo.loss import advantages, groups_with_spread, microbatch_weight, policy_loss


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
    loss, _ = policy_loss(logps, old, ref, torch.zeros(3), mask, beta=0.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logps.grad) == 0


def test_clipping_engages_beyond_epsilon():
    logps = torch.zeros(1, 4, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5, 1 / 1.1, 1 / 0.9, 1 / 0.5]]))  # ratios 1.5, 1.1, 0.9, 0.5
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(logps, old, None, torch.tensor([1.0]), mask, epsilon=0.2)
    loss.backward()
    # positive advantage: the ratio above 1.2 is clipped (no gradient), the ones inside are not,
    # and the ratio below 0.8 keeps its gradient (min picks the unclipped, lower value)
    assert logps.grad[0, 0] == 0
    assert (logps.grad[0, 1:] != 0).all()
    assert m["clip_frac"] == pytest.approx(0.25)
    logps.grad = None
    loss, m = policy_loss(logps, old, None, torch.tensor([-1.0]), mask, epsilon=0.2)
    loss.backward()
    assert logps.grad[0, 3] == 0 and (logps.grad[0, :3] != 0).all()
    assert m["clip_frac"] == pytest.approx(0.25)


def test_clip_higher_widens_only_the_upper_side():
    logps = torch.zeros(1, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.25]]))  # ratio 1.25
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, clipped = policy_loss(logps, old, None, torch.tensor([1.0]), mask, epsilon=0.2)
    _, unclipped = policy_loss(logps, old, None, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.28)
    assert clipped["clip_frac"] == 1.0 and unclipped["clip_frac"] == 0.0


def test_masked_tokens_do_not_count():
    logps, old, ref, adv, mask = _inputs()
    loss_a, _ = policy_loss(logps, old, ref, adv, mask, beta=0.1)
    garbage = logps.detach().clone()
    garbage[0, 3:] = 123.0  # only masked positions change
    loss_b, _ = policy_loss(garbage.requires_grad_(True), old, ref, adv, mask, beta=0.1)
    assert torch.allclose(loss_a, loss_b)
    loss_a.backward()
    assert torch.count_nonzero(logps.grad[0, 3:]) == 0


def test_kl_is_zero_when_policy_equals_reference():
    logps, old, _, adv, mask = _inputs()
    with_kl, m = policy_loss(logps, old, logps.detach(), adv, mask, beta=0.5)
    without, _ = policy_loss(logps, old, None, adv, mask, beta=0.0)
    assert m["kl"] == 0.0
    assert torch.allclose(with_kl, without)
    _, m = policy_loss(logps, old, logps.detach() - 0.5, adv, mask, beta=0.5)
    assert m["kl"] > 0


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_microbatches_add_up_to_the_whole_batch(aggregation):
    logps, old, ref, adv, mask = _inputs(B=4, T=6, seed=3)
    mask[2, 1:] = False
    kwargs = dict(beta=0.1, aggregation=aggregation, max_tokens=8)
    whole, _ = policy_loss(logps, old, ref, adv, mask, **kwargs)
    parts = 0
    for rows in (slice(0, 1), slice(1, 4)):
        loss, _ = policy_loss(logps[rows], old[rows], ref[rows], adv[rows], mask[rows], **kwargs)
        parts = parts + loss * microbatch_weight(mask[rows], mask, aggregation)
    assert torch.allclose(whole, parts)
