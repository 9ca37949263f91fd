"""The GRPO maths (learner.grpo) against direct per-sample loops written from the reference semantics."""
import math

import pytest
import torch

from nla_grpo.learner.grpo import grpo_loss, group_advantages, k3, logprob_mismatch


def _loop_loss(new, old, ref, adv, lengths, clip_eps, kl_beta):
    """The reference trainer's loss, sample by sample on unpadded rows (empty samples skipped)."""
    losses, kls, clips = [], [], []
    for i, L in enumerate(lengths):
        if L == 0:
            continue
        n, o, r = new[i, :L], old[i, :L], ref[i, :L]
        ratio = torch.exp(n - o)
        surrogate = torch.minimum(ratio * adv[i], torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv[i])
        delta = r - n
        kl = torch.exp(delta) - delta - 1.0
        losses.append((-(surrogate - kl_beta * kl)).mean())
        kls.append(kl.mean())
        clips.append(((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float().mean())
    return torch.stack(losses).mean(), torch.stack(kls).mean().item(), torch.stack(clips).mean().item()


def _random_batch(seed, lengths, T=9):
    g = torch.Generator().manual_seed(seed)
    N = len(lengths)
    new = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = new + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = new + 0.5 * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    # padding holds garbage that must not leak into the loss or its gradient
    pad = ~mask
    new, old, ref = new.masked_fill(pad, 50.0), old.masked_fill(pad, -math.inf), ref.masked_fill(pad, float("nan"))
    return new, old, ref, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_eps,kl_beta", [(0.2, 0.04), (0.1, 0.5)])
def test_grpo_loss_equals_the_per_sample_loop(seed, clip_eps, kl_beta):
    lengths = [3, 9, 1, 0, 5, 7]
    new, old, ref, adv, mask = _random_batch(seed, lengths)
    new = new.float().requires_grad_(True)
    loss, metrics = grpo_loss(new, old.float(), ref.float(), adv.float(), mask, clip_eps, kl_beta)
    loss.backward()
    new2 = new.detach().clone().requires_grad_(True)
    ref_loss, ref_kl, ref_clip = _loop_loss(new2, old.float(), ref.float(), adv.float(), lengths, clip_eps, kl_beta)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    assert abs(metrics["kl_mean"] - ref_kl) <= 1e-6 and abs(metrics["clip_frac"] - ref_clip) <= 1e-6
    assert torch.allclose(new.grad, new2.grad, atol=1e-7, rtol=0)
    assert torch.isfinite(new.grad).all() and (new.grad[~mask] == 0).all()


def test_k3_is_nonnegative_and_zero_on_equal_inputs():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(1000, generator=g) * 4, torch.randn(1000, generator=g) * 4
    assert (k3(a, b) >= 0).all()
    assert (k3(a, a) == 0).all()
    new, old, ref, adv, mask = _random_batch(4, [4, 9, 2])
    _, metrics = grpo_loss(new, old, ref, adv, mask)
    assert metrics["kl_mean"] >= 0


def test_clip_fraction_counts_exactly_the_tokens_outside_the_band():
    eps = 0.2
    # ratios chosen on both sides of and strictly inside the band; exact boundaries count as inside
    ratios = torch.tensor([[0.5, 0.8, 1.0, 1.2, 1.5], [1.21, 0.79, 1.0, 1.0, 1.0]], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0)
    new = old + torch.log(ratios)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    _, metrics = grpo_loss(new, old, new, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, eps, 0.0)
    outside = ((ratios < 1 - eps) | (ratios > 1 + eps)) & mask
    expected = (outside.sum(1).double() / mask.sum(1)).mean().item()
    assert metrics["clip_frac"] == pytest.approx(expected, abs=1e-12)
    assert metrics["clip_frac"] == pytest.approx((2 / 5 + 2 / 3) / 2, abs=1e-12)


def test_empty_mask_sample_is_ignored():
    new, old, ref, adv, mask = _random_batch(5, [4, 6, 3])
    full_loss, full_m = grpo_loss(new, old, ref, adv, mask)
    # a fourth sample with no tokens, garbage values and a huge advantage changes nothing
    pad = lambda x, v: torch.cat([x, torch.full((1, x.shape[1]), v, dtype=x.dtype)])
    loss, m = grpo_loss(pad(new, 3.0), pad(old, -9.0), pad(ref, float("nan")), torch.cat([adv, adv.new_tensor([1e6])]),
                        torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)]))
    assert loss.item() == pytest.approx(full_loss.item(), abs=1e-12)
    assert m["kl_mean"] == pytest.approx(full_m["kl_mean"]) and m["clip_frac"] == pytest.approx(full_m["clip_frac"])
    # nothing at all: a zero loss that still back-propagates
    x = new.clone().requires_grad_(True)
    zero, m0 = grpo_loss(x, old, ref, adv, torch.zeros_like(mask))
    zero.backward()
    assert zero.item() == 0.0 and m0["kl_mean"] == 0.0 and (x.grad == 0).all()


def test_no_reference_is_the_loss_without_its_kl_term():
    new, old, ref, adv, mask = _random_batch(7, [5, 2, 6])
    x, y = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    want, m_want = grpo_loss(x, old, ref, adv, mask, kl_beta=0.0)
    got, m_got = grpo_loss(y, old, None, adv, mask, kl_beta=0.04)  # β is moot without a reference
    want.backward()
    got.backward()
    assert got.item() == want.item() and torch.equal(x.grad, y.grad)
    assert m_got["kl_mean"] == 0.0 and m_want["kl_mean"] > 0 and m_got["clip_frac"] == m_want["clip_frac"]
    with_kl, _ = grpo_loss(new, old, ref, adv, mask, kl_beta=0.04)
    assert with_kl.item() != got.item()


def test_executed_flops_count_the_reference_pass_only_when_it_runs():
    from nla_grpo.learner.update_metrics import update_throughput

    n, seconds = 10 ** 9, 2.0
    full = update_throughput(n, 3000, 1000, 0, 1, seconds)
    bare = update_throughput(n, 3000, 1000, 0, 1, seconds, reference=False)
    assert full["learner/tflops_executed"] == pytest.approx(6 * n * 1000 / seconds / 1e12)
    assert bare["learner/tflops_executed"] == pytest.approx(4 * n * 1000 / seconds / 1e12)
    assert bare["learner/tflops_effective"] == pytest.approx(4 * n * 3000 / seconds / 1e12)
    rescored = update_throughput(n, 3000, 2000, 1000, 2, seconds, reference=False)
    assert rescored["learner/tflops_executed"] == pytest.approx((4 * 2000 + 2 * 1000) * n / seconds / 1e12)


def test_loss_at_ratio_one_is_minus_the_advantage():
    new = torch.tensor([[-1.0, -2.0]])
    loss, m = grpo_loss(new, new, new, torch.tensor([0.7]), torch.ones(1, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-0.7) and m["kl_mean"] == 0.0 and m["clip_frac"] == 0.0


def test_group_advantages():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 7.0, 0.5])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    adv = group_advantages(r, g)
    for gid in (0, 1):
        sel = g == gid
        expected = (r[sel] - r[sel].mean()) / (r[sel].std(unbiased=True) + 1e-6)
        assert torch.allclose(adv[sel], expected)
    assert adv[6] == 0.0  # single-sample group
    assert torch.allclose(adv[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)
    # all-equal group: zero advantage, not NaN
    assert (group_advantages([2.0, 2.0, 2.0], [4, 4, 4]) == 0).all()
    # eight samples that said the same thing: the critic gives them one reward, which float32 statistics
    # turned into an advantage of 0.056 each
    same = float(torch.tensor(1.4335, dtype=torch.float32))
    assert group_advantages(torch.full((8,), same), torch.zeros(8, dtype=torch.long)).abs().max() == 0.0
    assert group_advantages(torch.tensor([-math.log(2.3373525142669678)] * 8), [0] * 8).abs().max() == 0.0
    # groups need not be contiguous, ids need not be small
    mixed = group_advantages([1.0, 10.0, 3.0, 20.0], [7, 9, 7, 9])
    assert torch.allclose(mixed, torch.tensor([-1.0, -1.0, 1.0, 1.0]) / math.sqrt(2), atol=1e-5)
    assert group_advantages([1.0, 3.0], [0, 0], eps=1.0).tolist() == pytest.approx([-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)])
    with pytest.raises(ValueError, match="rewards"):
        group_advantages([1.0, 2.0], [0])


def test_logprob_mismatch():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    learner = torch.tensor([[-1.1, -2.0, -2.8], [-0.5, 99.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    mean_abs, k3_ = logprob_mismatch(rollout, learner, mask)
    assert mean_abs.tolist() == pytest.approx([0.3 / 3, 0.0], abs=1e-6)
    d = torch.tensor([-0.1, 0.0, 0.2])
    assert k3_[0].item() == pytest.approx((torch.exp(d) - d - 1).mean().item(), abs=1e-7)
    assert k3_[1].item() == 0.0


def test_micro_batch_losses_over_the_batch_count_add_up_to_the_batch_loss():
    lengths = [3, 9, 1, 0, 5, 7, 2]
    new, old, ref, adv, mask = _random_batch(4, lengths)
    keep = torch.tensor([True, True, False, True, True, True, True])  # sample 2 masked out (a bad weight sync)
    whole = new.float().requires_grad_(True)
    loss, m = grpo_loss(whole, old.float(), ref.float(), adv.float(), mask, sample_mask=keep)
    loss.backward()
    # the same samples without sample 2 at all: the reference semantics
    rows = [i for i in range(len(lengths)) if keep[i]]
    ref_loss, ref_kl, _ = _loop_loss(new.float()[rows], old.float()[rows], ref.float()[rows], adv.float()[rows],
                                     [lengths[i] for i in rows], 0.2, 0.04)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 and abs(m["kl_mean"] - ref_kl) <= 1e-6 and m["samples"] == 5
    parts = new.float().detach().clone().requires_grad_(True)
    total, sums = 0.0, {"loss_sum": 0.0, "samples": 0}
    for chunk in ([0, 1, 2], [3, 4], [5, 6]):
        part, pm = grpo_loss(parts[chunk], old.float()[chunk], ref.float()[chunk], adv.float()[chunk], mask[chunk],
                             sample_mask=keep[chunk], denominator=m["samples"])
        part.backward()
        total += part.item()
        sums = {"loss_sum": sums["loss_sum"] + pm["loss_sum"], "samples": sums["samples"] + pm["samples"]}
    assert abs(total - loss.item()) <= 1e-6 and sums["samples"] == m["samples"]
    assert abs(sums["loss_sum"] / sums["samples"] - loss.item()) <= 1e-6
    assert torch.allclose(parts.grad, whole.grad, atol=1e-7, rtol=0) and (whole.grad[2] == 0).all()


def test_tis_weights_are_the_capped_ratio_and_one_off_the_mask():
    from nla_grpo.learner.grpo import tis_weights

    learner = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, float("nan"), -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -3.0, -0.1, -9.0], [-2.0, -1.0, -math.inf, -1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    w = tis_weights(learner, rollout, mask, cap=2.0)
    want = torch.tensor([[1.0, 2.0, math.exp(-0.4), 1.0], [math.exp(-1.0), 1.0, 1.0, 1.0]])
    assert torch.allclose(w, want)
    assert w.max() <= 2.0 and not w.requires_grad


@pytest.mark.parametrize("seed", [0, 1])
def test_tis_weights_scale_each_tokens_policy_gradient(seed):
    """At one epoch (old = the learner's own logprobs) the surrogate's gradient per token is -w·A over the
    sample's tokens and the sample count; weights of 1 give the unweighted loss exactly."""
    from nla_grpo.learner.grpo import tis_weights

    lengths = [4, 9, 1, 6]
    new, _, ref, adv, mask = _random_batch(seed, lengths)
    rollout = new + 0.7 * torch.randn(new.shape, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)
    new = new.clone().requires_grad_(True)
    w = tis_weights(new.detach(), rollout, mask, cap=2.0)
    loss, _ = grpo_loss(new, new.detach(), ref, adv, mask, 0.2, 0.0, token_weights=w)
    loss.backward()
    L = torch.tensor(lengths, dtype=torch.float64).reshape(-1, 1)
    want = torch.where(mask, -w * adv.reshape(-1, 1) / L / len(lengths), torch.zeros_like(w))
    assert torch.allclose(new.grad, want)
    ones, _ = grpo_loss(new, new.detach(), ref, adv, mask, 0.2, 0.04, token_weights=torch.ones_like(w))
    plain, _ = grpo_loss(new, new.detach(), ref, adv, mask, 0.2, 0.04)
    assert torch.equal(ones, plain)
