"""Critic co-training and checkpoints on the tiny model (CPU, fp32)."""
import json

import pytest
import torch

from nla_grpo.shared.config import build_config
from nla_grpo.shared.data import read_rows
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.spec import load_spec

N_ROWS = 12


def _spec(tiny_dir):
    return load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")


def _cfg(tiny_dir, **critic):
    critic = {"train": True, "lr": 1e-3, "micro_batch": 5, **critic}
    return build_config({"model": {"path": str(tiny_dir / "model"), "dtype": "float32"}, "critic": critic})


def _batch(tiny_dir):
    """A fixed batch: each row's explanation names its topic (so the mapping is learnable)."""
    rows = read_rows(tiny_dir / "rl.parquet", _spec(tiny_dir).d_model, max_rows=N_ROWS)
    topics = json.loads((tiny_dir / "topics.json").read_text())[:N_ROWS]
    explanations = [f"{t} {t}" if i % 2 else t for i, t in enumerate(topics)]
    explanations[3] = None  # a failed rollout is left out of the step
    return explanations, torch.from_numpy(rows.activations)


def _service(tiny_dir, **critic):
    from nla_grpo.critic.scoring import Critic

    return Critic(_cfg(tiny_dir, **critic), _spec(tiny_dir))


def _mean_mse(service, explanations, golds):
    scores = [s for s in service.score(explanations, golds) if s is not None]
    return sum(scores) / len(scores)


def _weights(service):
    return {n: p.detach().clone() for n, p in service.model.named_parameters()}


def _optim_state(service):
    return {(i, k): v.clone() if torch.is_tensor(v) else v
            for i, s in service.optimizer.state_dict()["state"].items() for k, v in s.items()}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("lora_r", [0, 4])
def test_co_training_lowers_mse(tiny_dir, lora_r):
    critic = _service(tiny_dir, lora_r=lora_r, lr=3e-3 if lora_r else 1e-3)
    explanations, golds = _batch(tiny_dir)
    before = _mean_mse(critic, explanations, golds)
    base_frozen = {n: p.detach().clone() for n, p in critic.model.named_parameters() if "lora_" not in n and "value_head" not in n}
    losses = []
    for _ in range(8):
        result = critic.train_step(explanations, golds)
        assert result["critic_skipped"] is False and result["critic_n"] == N_ROWS - 1
        assert result["critic_grad_norm"] > 0
        losses.append(result["critic_loss"])
    after = _mean_mse(critic, explanations, golds)
    assert losses[0] == pytest.approx(before, abs=1e-5)  # the reported loss is the pre-step batch mean
    assert after < 0.8 * before, (before, after)
    assert losses[-1] < losses[0]
    changed = [n for n, p in critic.model.named_parameters() if n in base_frozen and not torch.equal(p, base_frozen[n])]
    if lora_r:
        assert changed == []  # LoRA leaves the base weights alone
    else:
        assert any(".layers.0." in n for n in changed)  # full fine-tuning moves the backbone


def test_gradient_accumulation_is_the_full_batch_mean(tiny_dir):
    explanations, golds = _batch(tiny_dir)
    results = [_service(tiny_dir, micro_batch=mb).train_step(explanations, golds) for mb in (1, 4, N_ROWS)]
    for r in results[1:]:
        assert r["critic_loss"] == pytest.approx(results[0]["critic_loss"], abs=1e-5)
        assert r["critic_grad_norm"] == pytest.approx(results[0]["critic_grad_norm"], rel=1e-4)


@pytest.mark.parametrize("poison", ["nan_gold", "inf_grad"])
def test_non_finite_step_is_skipped_bit_exactly(tiny_dir, poison):
    critic = _service(tiny_dir, lora_r=4)
    explanations, golds = _batch(tiny_dir)
    assert critic.train_step(explanations, golds)["critic_skipped"] is False  # optimiser state exists now
    weights, state = _weights(critic), _optim_state(critic)
    if poison == "nan_gold":
        golds = golds.clone()
        golds[7, 0] = float("nan")  # lands in the second micro-batch, after the first one's backward
        hook = None
    else:
        hook = critic.model.value_head.weight.register_hook(lambda g: g * float("inf"))
    result = critic.train_step(explanations, golds)
    if hook is not None:
        hook.remove()
    assert result["critic_skipped"] is True
    _assert_same(_weights(critic), weights)
    _assert_same(_optim_state(critic), state)
    assert all(p.grad is None for p in critic.model.parameters())
    clean = critic.train_step(*_batch(tiny_dir))
    assert clean["critic_skipped"] is False  # the next healthy step goes through


def test_no_valid_sample_takes_no_step(tiny_dir):
    critic = _service(tiny_dir)
    weights = _weights(critic)
    result = critic.train_step([None, None], torch.zeros(2, critic.spec.d_model))
    assert result["critic_skipped"] is True and result["critic_n"] == 0
    _assert_same(_weights(critic), weights)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_save_load_is_bit_identical_and_resumes_exactly(tiny_dir, tmp_path, lora_r):
    explanations, golds = _batch(tiny_dir)
    trained = _service(tiny_dir, lora_r=lora_r)
    for _ in range(2):
        trained.train_step(explanations, golds)
    trained.save(tmp_path / "ck")

    restored = _service(tiny_dir, lora_r=lora_r)
    fresh_pred = restored.predict_ids(restored.encode(["sea"]))
    restored.load(tmp_path / "ck", require_optimizer=True)
    ids = trained.encode(explanations[:3])
    assert torch.equal(restored.predict_ids(ids), trained.predict_ids(ids))
    assert not torch.equal(fresh_pred, trained.predict_ids(trained.encode(["sea"])))  # training did move it
    _assert_same(_optim_state(restored), _optim_state(trained))

    # exact resume: the next step is the same step
    assert restored.train_step(explanations, golds) == trained.train_step(explanations, golds)
    _assert_same(_weights(restored), _weights(trained))

    # the config route (critic.checkpoint) loads the same weights
    from nla_grpo.critic.scoring import Critic

    via_cfg = Critic(_cfg(tiny_dir, lora_r=lora_r, checkpoint=str(tmp_path / "ck")), _spec(tiny_dir))
    assert torch.equal(via_cfg.predict_ids(ids), _service_pred_after_load(tiny_dir, lora_r, tmp_path / "ck", ids))


def _service_pred_after_load(tiny_dir, lora_r, ckpt, ids):
    s = _service(tiny_dir, lora_r=lora_r)
    s.load(ckpt)
    return s.predict_ids(ids)


def _rewrite_weights(ckpt, edit):
    from safetensors.torch import load_file, save_file

    path = ckpt / "critic_weights.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("lora_r", [0, 4])
def test_checkpoint_with_missing_or_extra_key_is_refused(tiny_dir, tmp_path, lora_r):
    critic = _service(tiny_dir, lora_r=lora_r)
    critic.save(tmp_path / "ck", optimizer=False)
    victim = "value_head.bias" if lora_r == 0 else next(n for n in critic.model.trainable_names() if "lora_B" in n)

    _rewrite_weights(tmp_path / "ck", lambda t: t.pop(victim))
    with pytest.raises(NlaInputError, match="missing tensor") as err:
        _service(tiny_dir, lora_r=lora_r).load(tmp_path / "ck")
    assert victim in str(err.value) and "critic_weights.safetensors" in str(err.value)

    critic.save(tmp_path / "ck", optimizer=False)
    _rewrite_weights(tmp_path / "ck", lambda t: t.update({"value_head.extra": torch.zeros(3)}))
    with pytest.raises(NlaInputError, match="unexpected tensor 'value_head.extra'"):
        _service(tiny_dir, lora_r=lora_r).load(tmp_path / "ck")
    with pytest.raises(NlaInputError, match="value_head.extra"):
        _service(tiny_dir, lora_r=lora_r, checkpoint=str(tmp_path / "ck"))


def test_checkpoint_structure_mismatch_is_refused(tiny_dir, tmp_path):
    _service(tiny_dir, lora_r=4).save(tmp_path / "lora")
    with pytest.raises(NlaInputError, match="lora_r"):
        _service(tiny_dir, lora_r=0).load(tmp_path / "lora")
    with pytest.raises(NlaInputError, match="lora_r"):
        _service(tiny_dir, lora_r=0, checkpoint=str(tmp_path / "lora"))
    with pytest.raises(NlaInputError, match="optimiser state"):
        _service(tiny_dir, lora_r=4).load(tmp_path / "lora", require_optimizer=True)  # saved before any step
    meta = tmp_path / "lora" / "critic_meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "d_model": "64"}))
    with pytest.raises(NlaInputError, match="d_model"):
        _service(tiny_dir, lora_r=4).load(tmp_path / "lora")
