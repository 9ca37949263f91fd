"""Critic scoring on the tiny model: batching, the identity head at init, the token limit, None handling."""
import math

import numpy as np
import pytest
import torch

from critic_support import fold_offsets, train_lora_b
from nla_grpo.shared.config import CriticConfig, build_config
from nla_grpo.shared.data import read_rows
from nla_grpo.shared.prompts import render_critic_ids
from nla_grpo.shared.schema import normalize_activation
from nla_grpo.shared.spec import load_spec

# mixed lengths, so every micro-batch but the one-at-a-time case has padding
EXPLANATIONS = [
    "sea",
    "tree leaf moss wolf pine branch root owl trail fern " * 3,
    "street tower bus",
    "",
    "bread oven salt knife soup pan spice butter table fork",
    "wave",
    "market bridge light traffic shop noise crowd " * 2,
]


def _spec(tiny_dir):
    return load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")


def _cfg(tiny_dir, **critic):
    return build_config({"model": {"path": str(tiny_dir / "model"), "dtype": "float32"}, "critic": critic})


def _golds(tiny_dir, n):
    spec = _spec(tiny_dir)
    return torch.from_numpy(read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=n).activations)


@pytest.fixture(scope="module")
def service(tiny_dir):
    from nla_grpo.critic.scoring import Critic

    return Critic(_cfg(tiny_dir, micro_batch=len(EXPLANATIONS)), _spec(tiny_dir))


def test_backbone_is_truncated_and_unnormed(service):
    backbone = service.model.backbone
    assert len(backbone.layers) == service.spec.layer_index + 1
    assert isinstance(backbone.norm, torch.nn.Identity)
    assert not hasattr(service.model, "lm_head") and not hasattr(backbone, "lm_head")
    assert service.model.value_head.weight.dtype == torch.float32


@pytest.mark.parametrize("micro_batch", [1, 3, len(EXPLANATIONS)])
def test_batched_scores_equal_one_at_a_time(service, tiny_dir, micro_batch, monkeypatch):
    golds = _golds(tiny_dir, len(EXPLANATIONS))
    singles = [service.score([e], golds[i:i + 1])[0] for i, e in enumerate(EXPLANATIONS)]
    monkeypatch.setattr(service.cfg.critic, "micro_batch", micro_batch)
    batched = service.score(EXPLANATIONS, golds)
    assert len(set(round(s, 4) for s in singles)) > 3, "scores should depend on the explanation"
    for a, b in zip(batched, singles):
        assert abs(a - b) <= 1e-5

    ids = service.encode(EXPLANATIONS)
    preds = service.predict_ids(ids)
    for i, one in enumerate(ids):
        assert torch.allclose(preds[i], service.predict_ids([one])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_identity_head_at_init_predicts_normalised_hidden_state(tiny_dir, num_layers):
    """Prediction = the residual stream after block num_layers-1 (pre final norm), normalised."""
    from transformers import AutoModelForCausalLM

    from nla_grpo.critic.scoring import Critic

    spec = _spec(tiny_dir)
    critic = Critic(_cfg(tiny_dir, num_layers=num_layers, micro_batch=4), spec)
    full = AutoModelForCausalLM.from_pretrained(str(tiny_dir / "model"), dtype=torch.float32).eval()
    captured = {}

    def keep_output(_module, _args, output):
        captured["h"] = output[0] if isinstance(output, tuple) else output

    hook = full.model.layers[num_layers - 1].register_forward_hook(keep_output)
    ids = critic.encode(EXPLANATIONS)
    expected = []
    try:
        with torch.no_grad():
            for one in ids:
                out = full(torch.tensor([one]), output_hidden_states=True)
                h = captured["h"][0, -1]
                if num_layers < full.config.num_hidden_layers:
                    # without a final norm in between, HF's hidden_states[k] is the same stream
                    assert torch.allclose(out.hidden_states[num_layers][0, -1], h, atol=1e-6)
                expected.append(normalize_activation(h, spec.mse_scale))
    finally:
        hook.remove()
    preds = critic.predict_ids(ids)  # padded micro-batches of 4
    assert torch.allclose(preds, torch.stack(expected), atol=1e-5, rtol=0)
    assert torch.allclose(preds.norm(dim=-1), torch.full((len(ids),), math.sqrt(spec.d_model)), atol=1e-4)


def test_prompt_token_limit_and_none(tiny_dir, service, monkeypatch):
    assert CriticConfig().max_prompt_tokens == 1024
    long_expl = "sea wave salt ship tide fish coral " * 6
    n_long = len(render_critic_ids(service.tokenizer, service.spec.ar_template, long_expl))
    n_short = len(render_critic_ids(service.tokenizer, service.spec.ar_template, "sea"))
    assert n_short < n_long - 1
    golds = _golds(tiny_dir, 4)
    expl = [None, long_expl, "sea", None]

    monkeypatch.setattr(service.cfg.critic, "max_prompt_tokens", n_long)  # exactly at the limit: scored
    at_limit = service.score(expl, golds)
    monkeypatch.setattr(service.cfg.critic, "max_prompt_tokens", n_long - 1)  # one over: failed
    over = service.score(expl, golds)

    assert at_limit[0] is None and at_limit[3] is None
    assert isinstance(at_limit[1], float) and isinstance(at_limit[2], float)
    assert over[1] is None and over[0] is None and over[3] is None
    assert over[2] == pytest.approx(at_limit[2], abs=1e-6)
    assert at_limit[2] == pytest.approx(service.score(["sea"], golds[2:3])[0], abs=1e-5)  # order kept


def test_non_finite_gold_scores_none_and_empty_batch(service, tiny_dir):
    golds = _golds(tiny_dir, 3).clone()
    golds[1, 5] = float("nan")
    scores = service.score(["sea", "tree", "bus"], golds)
    assert scores[1] is None and scores[0] is not None and scores[2] is not None
    assert service.score([], np.zeros((0, service.spec.d_model), np.float32)) == []
    with pytest.raises(ValueError, match="activations"):
        service.score(["sea"], golds)


def test_orthogonal_gold_scores_two(service):
    """With sqrt_d normalisation, a gold orthogonal to the prediction scores exactly 2."""
    ids = service.encode(["sea"])
    pred = service.predict_ids(ids)[0]
    other = torch.randn(service.spec.d_model, generator=torch.Generator().manual_seed(0))
    ortho = other - (other @ pred) / (pred @ pred) * pred
    assert service.score(["sea"], ortho[None])[0] == pytest.approx(2.0, abs=1e-4)
    assert service.score(["sea"], (3.0 * pred)[None])[0] == pytest.approx(0.0, abs=1e-6)


def test_a_merged_lora_critic_predicts_what_its_adapters_do(tiny_dir, tmp_path):
    """Reading folds the critic's LoRA into its base (``merge_lora``): the same predictions, and no way left to
    train, save or load it (the delta would count twice)."""
    from nla_grpo.critic.scoring import Critic

    critic = Critic(_cfg(tiny_dir, lora_r=4, lora_alpha=8, micro_batch=3), _spec(tiny_dir))
    ids = [x for x in critic.encode(EXPLANATIONS) if x is not None]
    base = critic.predict_ids(ids)
    train_lora_b(critic)
    adapters = critic.predict_ids(ids)
    assert (adapters - base).abs().max() > 1e-2, "the adapter should change the predictions"

    assert critic.model.merge_lora() and not critic.model.merge_lora()  # once
    with torch.no_grad():  # the delta now lives in the base weights, and the adapters no longer run
        for name, p in critic.model.backbone.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    merged = critic.predict_ids(ids)
    assert torch.allclose(merged, adapters, atol=1e-5, rtol=0)
    golds = _golds(tiny_dir, len(EXPLANATIONS))
    for refused in (lambda: critic.train_step(EXPLANATIONS, golds), lambda: critic.save(tmp_path / "c"),
                    lambda: critic.load(tmp_path / "c")):
        with pytest.raises(RuntimeError, match="merged"):
            refused()
    assert not (tmp_path / "c").exists()


def test_a_merged_bf16_critic_scores_as_close_to_fp32_as_its_adapters_do(tiny_dir):
    """In bf16 the fold rounds each delta into its base weight: its scores stay as close to the fp32 critic's as the
    adapters beside the bf16 base do (the GPU's: ``tests/test_gpu.py``)."""
    off_adapters, off_merged = fold_offsets(tiny_dir, "cpu")
    assert 0 < off_adapters <= 2e-2 and off_merged <= max(2e-2, 2 * off_adapters), (off_adapters, off_merged)
