import math

import pytest
import torch

from nla_grpo.shared.schema import (
    FAILED_EXTRACTION_REWARD, extract_explanation, fve, fve_baselines, normalize_activation, normalized_mse,
    resolve_scale, reward_from_mse,
)


@pytest.mark.parametrize("text,expected", [
    ("<explanation>ocean waves</explanation>", "ocean waves"),
    ("noise <explanation>\n  a b \n</explanation> tail <explanation>second</explanation>", "a b"),
    ("<explanation>unclosed", None),
    ("no tags at all", None),
    ("", None),
    (None, None),
    ("<explanation></explanation>", ""),
])
def test_extract_explanation(text, expected):
    assert extract_explanation(text) == expected


def test_normalize_to_sqrt_d_and_passthrough():
    d = 64
    x = torch.randn(5, d) * 7
    y = normalize_activation(x, resolve_scale("sqrt_d_model", d))
    assert torch.allclose(y.norm(dim=-1), torch.full((5,), math.sqrt(d)), rtol=1e-5)
    assert normalize_activation(x, None) is x
    z = normalize_activation(torch.zeros(2, d), 8.0)
    assert torch.equal(z, torch.zeros(2, d))
    assert normalize_activation(x.to(torch.bfloat16), 8.0).dtype == torch.bfloat16
    # idempotent
    assert torch.allclose(normalize_activation(y, math.sqrt(d)), y, rtol=1e-6)


def test_orthogonal_vectors_score_two_and_identical_zero():
    d = 64
    a = torch.zeros(d); a[0] = 3.0
    b = torch.zeros(d); b[1] = 0.01
    scale = resolve_scale("sqrt_d_model", d)
    assert normalized_mse(a[None], b[None], scale).item() == pytest.approx(2.0, abs=1e-6)
    assert normalized_mse(a[None], 5 * a[None], scale).item() == pytest.approx(0.0, abs=1e-9)
    assert normalized_mse(a[None], -a[None], scale).item() == pytest.approx(4.0, abs=1e-6)


def test_reward_semantics():
    assert FAILED_EXTRACTION_REWARD == -2.0
    assert reward_from_mse(None) == -2.0
    assert reward_from_mse(float("nan")) == -2.0
    assert reward_from_mse(float("inf")) == -2.0
    assert reward_from_mse(0.5) == pytest.approx(-math.log(0.5))
    assert reward_from_mse(2.0) == pytest.approx(-math.log(2.0))
    assert reward_from_mse(0.5, kind="neg_mse") == -0.5
    assert reward_from_mse(None, failed=-3.0) == -3.0
    with pytest.raises(ValueError):
        reward_from_mse(0.5, kind="bogus")


def test_resolve_scale():
    assert resolve_scale(None, 16) is None
    assert resolve_scale("raw", 16) is None
    assert resolve_scale("sqrt_d_model", 16) == 4.0
    assert resolve_scale(2.5, 16) == 2.5
    assert resolve_scale("3", 16) == 3.0
    with pytest.raises(ValueError):
        resolve_scale(-1, 16)


def test_fve_baselines_match_hand_computation():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(200, 16, generator=g) + torch.tensor([3.0] + [0.0] * 15)
    scale = 4.0
    meannorm, rawvar = fve_baselines(v, scale)
    vn = v / v.norm(dim=-1, keepdim=True) * scale
    mu = vn.mean(0)
    assert rawvar == pytest.approx(((vn - mu) ** 2).sum(-1).mean().item() / 16, rel=1e-5)
    mu_n = mu / mu.norm() * scale
    assert meannorm == pytest.approx(((vn - mu_n) ** 2).mean().item(), rel=1e-5)
    assert meannorm > rawvar  # renormalising the mean can only be a worse constant
    assert fve(rawvar, rawvar) == 0.0 and fve(0.0, rawvar) == 1.0
