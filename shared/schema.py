"""Explanation parsing, activation normalisation, reward and FVE: the reference trainer's semantics.

All functions are pure. Scales follow the NLA sidecar: a number (target L2 norm), ``"sqrt_d_model"``
(or ``"sqrt_d"``) for sqrt(d), or ``None`` / ``"raw"`` for no rescaling.
"""
from __future__ import annotations

import math
import re

FAILED_EXTRACTION_REWARD = -2.0
EXPLANATION_OPEN = "<explanation>"
EXPLANATION_CLOSE = "</explanation>"
_EXPLANATION_RE = re.compile(re.escape(EXPLANATION_OPEN) + r"(.*?)" + re.escape(EXPLANATION_CLOSE), re.DOTALL)
REWARD_KINDS = ("neg_log_mse", "neg_mse")


def extract_explanation(text: str | None) -> str | None:
    """The first ``<explanation>…</explanation>`` payload, whitespace-stripped; None when absent."""
    if not text:
        return None
    m = _EXPLANATION_RE.search(text)
    return m.group(1).strip() if m else None


def resolve_scale(raw, d_model: int) -> float | None:
    """Turn a sidecar/config scale into a target L2 norm, or None for "leave unchanged"."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("raw", "none")):
        return None
    if isinstance(raw, str) and raw.strip().lower() in ("sqrt_d_model", "sqrt_d"):
        return math.sqrt(d_model)
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be positive and finite, found {raw!r}")
    return value


def normalize_activation(x, scale: float | None):
    """Rescale the last axis of ``x`` to L2 norm ``scale`` (``None``: returned unchanged).

    The norm is taken in fp32; zero vectors stay zero; the result keeps ``x``'s dtype.
    """
    if scale is None:
        return x
    norm = x.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return x / (norm / scale).to(x.dtype)


def normalized_mse(pred, gold, scale: float | None):
    """Per-row ``mean((norm(pred) - norm(gold))**2)`` in fp32; with scale sqrt(d), orthogonal = 2."""
    p = normalize_activation(pred.float(), scale)
    g = normalize_activation(gold.float(), scale)
    return ((p - g) ** 2).mean(dim=-1)


def reward_from_mse(mse: float | None, kind: str = "neg_log_mse", failed: float = FAILED_EXTRACTION_REWARD) -> float:
    """``-log(mse)`` (or ``-mse``); ``failed`` for a missing or non-finite mse."""
    if kind not in REWARD_KINDS:
        raise ValueError(f"reward kind must be one of {REWARD_KINDS}, found {kind!r}")
    if mse is None or not math.isfinite(mse) or mse < 0:
        return float(failed)
    if kind == "neg_mse":
        return -float(mse)
    return -math.log(max(float(mse), 1e-12))


def fve_baselines(golds, scale: float | None) -> tuple[float, float]:
    """Predict-the-mean MSEs over normalised golds ``v_n``: ``(meannorm, raw_variance)``.

    ``raw_variance = mean ||v_n - mu||^2 / d`` with ``mu`` the mean of ``v_n``, *not* renormalised:
    the FVE denominator. ``meannorm`` scores ``normalize(mu)`` instead (a constant the critic could
    emit after normalisation); logged for comparison only.
    """
    v = normalize_activation(golds.float(), scale)
    mu = v.mean(dim=0, keepdim=True)
    meannorm = ((v - normalize_activation(mu, scale)) ** 2).mean().item()
    raw_variance = ((v - mu) ** 2).mean().item()
    return meannorm, raw_variance


def fve(mse_mean: float, baseline: float) -> float:
    """Fraction of variance explained: ``1 - mse / baseline``."""
    return 1.0 - mse_mean / baseline
