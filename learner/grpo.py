"""GRPO maths as pure tensor functions: group advantages, the clipped-surrogate + k3 loss, the
truncated importance weights, and the rollout/learner logprob mismatch.

Shapes: ``N`` samples, ``T`` response tokens padded to the longest; ``mask[N, T]`` is True on real
tokens. Values under a False mask may be anything (padding, -inf): they are replaced before any
arithmetic, so they can neither leak into the loss nor turn a gradient into NaN.
"""
from __future__ import annotations

import torch


def group_advantages(rewards, group_ids, eps: float = 1e-6) -> torch.Tensor:
    """Per-prompt normalised rewards ``(r - mean_g) / (std_g + eps)``.

    ``std`` is the unbiased (n-1) standard deviation of the group, as the reference trainer uses;
    a group with a single sample, or whose rewards are all equal, gets advantage 0 (there is nothing
    to compare). The statistics are taken in float64: in float32 the mean of eight equal rewards
    near 1.5 misses them by an ulp, and divided by ``std + eps`` = 1e-6 that rounding became an
    advantage of about ±0.06 on every group whose samples agree.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(group_ids)
    if r.ndim != 1 or g.shape != r.shape:
        raise ValueError(f"expected rewards[N] and group_ids[N], found {tuple(r.shape)} and {tuple(g.shape)}")
    adv = torch.zeros_like(r)
    for gid in torch.unique(g):
        sel = g == gid
        group = r[sel]
        if group.numel() < 2 or bool((group == group[0]).all()):
            continue
        adv[sel] = (group - group.mean()) / (group.std() + eps)
    return adv.to(torch.float32)


def k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(q-sampler || p): ``exp(d) - d - 1`` with ``d = log_p - log_q``; always >= 0."""
    d = log_p - log_q
    return torch.exp(d) - d - 1.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's masked entries; 0 for a row without any."""
    count = mask.sum(dim=-1)
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1) / count.clamp_min(1).to(x.dtype)


def tis_weights(learner_logp, rollout_logp, mask, cap: float) -> torch.Tensor:
    """Token-level truncated importance weights ``min(exp(learner - rollout), cap)`` (constants).

    ``learner`` is the learner's logprob of the sampled token before the step, ``rollout`` the engine's:
    the weight corrects the gradient for tokens the engine sampled under a slightly different policy
    (another kernel, merged weights, one step behind), and the cap bounds its variance. Off the mask,
    and where either logprob is not finite, the weight is 1.
    """
    mask = mask.bool()
    a, b = learner_logp.detach().float(), rollout_logp.detach().float()
    ok = mask & torch.isfinite(a) & torch.isfinite(b)
    d = torch.where(ok, a - b, torch.zeros_like(a))
    return torch.where(ok, torch.exp(d).clamp(max=cap), torch.ones_like(a))


def per_sample_grpo_terms(new_logp, old_logp, ref_logp, advantages, mask, clip_eps: float = 0.2, kl_beta: float = 0.04,
                          token_weights=None):
    """Per-sample ``(loss[N], kl[N], clip_frac[N], has_tokens[N])`` of the GRPO objective.

    Per token: ``-(w·min(r·A, clip(r, 1-ε, 1+ε)·A) - β·k3)`` with ``r = exp(new - old)``,
    ``k3 = exp(ref - new) - (ref - new) - 1`` and ``w`` the ``token_weights`` (``tis_weights``; 1 when
    None); each is averaged over the sample's own tokens. ``old``, ``ref`` and ``w`` are treated as
    constants. Samples without tokens get zeros and ``has_tokens`` False; callers average over the others.
    ``ref_logp`` None (``kl_beta`` 0, no reference pass): no KL term, and ``kl`` is zeros.
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=new_logp.dtype, device=new_logp.device)
    # sanitise padding first: where() alone would still back-propagate NaN from exp(inf)
    new = torch.where(mask, new_logp, zero)
    old = torch.where(mask, old_logp.detach().to(new.dtype), zero)
    adv = advantages.detach().to(new.dtype).reshape(-1, 1)

    ratio = torch.exp(new - old)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if token_weights is not None:
        surrogate = surrogate * torch.where(mask, token_weights.detach().to(new.dtype), zero)
    if ref_logp is None:
        kl = torch.zeros_like(new)
        per_token = -surrogate
    else:
        kl = k3(torch.where(mask, ref_logp.detach().to(new.dtype), zero), new)
        per_token = -(surrogate - kl_beta * kl)

    outside = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).to(new.dtype)
    return (
        _masked_mean(per_token, mask),
        _masked_mean(kl, mask).detach(),
        _masked_mean(outside, mask).detach(),
        mask.any(dim=-1),
    )


def grpo_loss(new_logp, old_logp, ref_logp, advantages, mask, clip_eps: float = 0.2, kl_beta: float = 0.04,
              sample_mask=None, denominator: int | None = None, token_weights=None):
    """GRPO loss over a batch: per token, mean over each sample's mask, mean over samples with >= 1 token.

    Returns ``(loss, metrics)``; ``metrics['kl_mean']`` and ``metrics['clip_frac']`` are per-sample
    means averaged over the same samples (the reference trainer's definitions), ``samples`` their
    count and ``loss_sum`` / ``kl_sum`` / ``clip_sum`` the sums behind the means. A batch without
    any token gives a zero loss that still back-propagates (zeros).

    For a micro-batch of a larger batch: ``sample_mask[N]`` leaves samples out (as if absent) and
    ``denominator`` replaces the count of samples the sum is divided by, so that the micro-batches'
    losses (and gradients) add up to the whole batch's when it is the batch's count. ``token_weights``:
    see ``per_sample_grpo_terms``.
    """
    loss_n, kl_n, clip_n, has = per_sample_grpo_terms(new_logp, old_logp, ref_logp, advantages, mask, clip_eps, kl_beta,
                                                      token_weights)
    use = has if sample_mask is None else has & sample_mask.to(has.device).bool()
    n = int(use.sum())
    if n == 0:
        return loss_n.sum() * 0.0, {"kl_mean": 0.0, "clip_frac": 0.0, "samples": 0, "loss_sum": 0.0, "kl_sum": 0.0,
                                    "clip_sum": 0.0}
    loss = loss_n[use].sum() / (n if denominator is None else denominator)
    sums = {"loss_sum": float(loss_n[use].detach().sum()), "kl_sum": float(kl_n[use].sum()), "clip_sum": float(clip_n[use].sum())}
    return loss, {"kl_mean": sums["kl_sum"] / n, "clip_frac": sums["clip_sum"] / n, "samples": n, **sums}


def logprob_mismatch(rollout_logp, learner_logp, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: mean ``|rollout - learner|`` and mean k3(rollout || learner) over its tokens.

    k3 uses the rollout's own samples: ``exp(learner - rollout) - (learner - rollout) - 1``. Large
    values mean the two engines do not run the same policy (weights or injection out of sync).
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    a = torch.where(mask, rollout_logp.detach().float(), zero)
    b = torch.where(mask, learner_logp.detach().float(), zero)
    return _masked_mean((a - b).abs(), mask), _masked_mean(k3(b, a), mask)


def pad_rows(rows: list[torch.Tensor], T: int, device) -> torch.Tensor:
    """Ragged 1-D rows as one fp32 ``[len(rows), T]`` matrix, zero-padded on the right."""
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for r, x in enumerate(rows):
        out[r, : x.numel()] = x
    return out.to(device)


def ragged_mismatch(rollout: list[torch.Tensor], learner: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """``logprob_mismatch`` per sample, (mean |Δlogp|, k3), between ragged rollout and learner rows."""
    if not rollout:  # a data-parallel rank with no sample
        return [], []
    T = max(x.numel() for x in rollout)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([x.numel() for x in rollout]).unsqueeze(1)
    a, k = logprob_mismatch(pad_rows(rollout, T, "cpu"), pad_rows(learner, T, "cpu"), mask)
    return a.tolist(), k.tolist()
