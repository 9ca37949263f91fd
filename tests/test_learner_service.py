"""The Learner on the tiny model (CPU, fp32): fused update, masks, guards, export and exact resume."""
import copy
import json
import math

import pytest
import torch

from nla_grpo.learner.policy import POLICY, REFERENCE
from nla_grpo.learner.learner import Learner
from nla_grpo.shared.errors import NlaInputError
from test_learner_support import load_tiny_spec, make_cfg, sample_responses

MODES = ("embed", "karvonen")


@pytest.fixture(scope="module")
def rollouts(tiny_dir):
    """Per mode: synthetic samples (3 prompts × 2) and their vectors."""
    return {mode: sample_responses(tiny_dir, mode, n_prompts=3, group=2, max_new=6) for mode in MODES}


def _learner(tiny_dir, mode="embed", **learner):
    # the tests reuse one set of rollouts across several steps, so after a step they are stale by
    # design: the mismatch mask is off unless a test is about it
    learner.setdefault("mismatch_mask_k3", 1e6)
    return Learner(make_cfg(tiny_dir, mode, **learner), load_tiny_spec(tiny_dir))


def _adv(n):
    return [(-1.0) ** i * (1 + 0.1 * i) for i in range(n)]


def _adapter(learner, name=POLICY):
    return {k: p.detach().clone() for k, p in learner.policy.adapter_parameters(name).items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _grads(learner, samples, advantages, vectors):
    """The gradient one update would step with (no step taken)."""
    from nla_grpo.learner.micro_batches import items_from as _items

    items = _items(samples, vectors, advantages)
    learner.optimizer.zero_grad(set_to_none=True)
    stats = learner._accumulate(items, [it.rollout_logp for it in items], None)
    grads = {k: p.grad.detach().clone() for k, p in learner.policy.adapter_parameters(POLICY).items()}
    learner.optimizer.zero_grad(set_to_none=True)
    return grads, stats


def _optimizer_snapshot(opt):
    sd = opt.state_dict()
    return copy.deepcopy({"state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in e.items()}
                                    for k, e in sd["state"].items()}, "groups": sd["param_groups"]})


def _same_optimizer(a, b):
    if a["groups"] != b["groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        for n, v in a["state"][k].items():
            w = b["state"][k][n]
            if not (torch.equal(v, w) if torch.is_tensor(v) else v == w):
                return False
    return True


def test_only_the_policy_adapter_trains_and_reference_starts_equal(tiny_dir):
    learner = _learner(tiny_dir)
    named = dict(learner.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(f".{POLICY}." in n and "lora_" in n for n in trainable)
    assert _equal(_adapter(learner, POLICY), _adapter(learner, REFERENCE))
    assert sum(p.numel() for p in learner.params) == sum(p.numel() for n, p in named.items() if f".{POLICY}." in n)
    # a fresh adapter is seeded: the same config gives the same tensors, whatever the global RNG did
    torch.manual_seed(1234)
    assert _equal(_adapter(learner), _adapter(_learner(tiny_dir)))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_do_not_depend_on_the_micro_batch(tiny_dir, rollouts, mode):
    samples, vectors = rollouts[mode]
    learner = _learner(tiny_dir, mode, micro_batch=4, lr=1e-2)
    learner.update(samples, _adv(len(samples)), vectors)  # move off B = 0 so every LoRA tensor has a gradient
    g4, s4 = _grads(learner, samples, _adv(len(samples)), vectors)
    learner.cfg.learner.micro_batch = 1
    g1, s1 = _grads(learner, samples, _adv(len(samples)), vectors)
    assert all(g4[k].abs().max() > 0 for k in g4)
    assert max((g4[k] - g1[k]).abs().max().item() for k in g4) <= 1e-5
    assert s4["loss"] == pytest.approx(s1["loss"], rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_high_lr_update_moves_logprobs_with_the_advantage_sign(tiny_dir, rollouts, mode):
    samples, vectors = rollouts[mode]
    pick = [1, 2]  # two prompts, different lengths
    samples, vectors = [samples[i] for i in pick], vectors[pick]
    learner = _learner(tiny_dir, mode, lr=3e-2)
    before = [sum(x) for x in learner.logprobs(samples, vectors)]
    metrics = learner.update(samples, [1.0, -1.0], vectors)
    after = [sum(x) for x in learner.logprobs(samples, vectors)]
    assert not metrics["skipped"] and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["logprob_mismatch_mean_abs"] < 1e-5 and metrics["masked"] == 0
    assert set(metrics) >= {"loss", "grad_norm", "kl_mean", "clip_frac", "logprob_mismatch_mean_abs",
                            "logprob_mismatch_k3", "masked", "skipped"}


def test_kl_beta_zero_skips_the_reference_pass_and_keeps_the_gradient(tiny_dir, rollouts):
    samples, vectors = rollouts["karvonen"]
    cfg = make_cfg(tiny_dir, "karvonen", lr=1e-2, mismatch_mask_k3=1e6)
    cfg.grpo.kl_beta = 0.0
    bare, forced = Learner(cfg, load_tiny_spec(tiny_dir)), Learner(cfg, load_tiny_spec(tiny_dir))
    forced.reference_pass = True  # the pass run anyway: its KL term weighs 0
    passes = {}
    for name, learner in (("bare", bare), ("forced", forced)):
        forward = learner.policy.forward_logprobs

        def counted(batch, forward=forward, name=name):
            passes[name] = passes.get(name, 0) + 1
            return forward(batch)

        learner.policy.forward_logprobs = counted
    m_bare = bare.update(samples, _adv(len(samples)), vectors)
    m_forced = forced.update(samples, _adv(len(samples)), vectors)
    assert passes["forced"] == 2 * passes["bare"] > 0  # one forward per micro-batch instead of two
    assert "kl_mean" not in m_bare and m_forced["kl_mean"] >= 0
    assert m_bare["loss"] == m_forced["loss"] and m_bare["learner/executed_tokens"] == m_forced["learner/executed_tokens"]
    g_bare, _ = _grads(bare, samples, _adv(len(samples)), vectors)  # off the first step: LoRA B != 0
    g_forced, _ = _grads(forced, samples, _adv(len(samples)), vectors)
    assert all(g_bare[k].abs().max() > 0 and torch.equal(g_bare[k], g_forced[k]) for k in g_bare)


def test_reference_adapter_is_bit_identical_after_updates_and_resume(tiny_dir, rollouts, tmp_path):
    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir, lr=1e-2)
    ref0, pol0 = _adapter(learner, REFERENCE), _adapter(learner, POLICY)
    for k in range(3):
        m = learner.update(samples, _adv(len(samples)), vectors)
        assert not m["skipped"]
    assert _equal(_adapter(learner, REFERENCE), ref0) and not _equal(_adapter(learner, POLICY), pol0)
    # after the policy moved, the reference forward still gives the initial policy's logprobs
    for lp, s in zip(learner.logprobs(samples, vectors, REFERENCE), samples):
        assert lp == pytest.approx(s.logprobs, abs=1e-5)
    assert m["kl_mean"] > 0
    learner.save(tmp_path / "ckpt")
    # by reference: the frozen adapter once beside the run, the checkpoint a record of its SHA-256
    frozen = learner.save_reference(tmp_path / "run" / "frozen" / "reference")
    learner.save(tmp_path / "run" / "checkpoints" / "ckpt", reference=str(frozen))
    by_ref = tmp_path / "run" / "checkpoints" / "ckpt"
    assert not (by_ref / "reference").exists() and (by_ref / "reference.json").is_file()
    assert (tmp_path / "ckpt" / "reference").is_dir()
    # every adapter the learner writes records the injection it was trained with
    for d in (tmp_path / "ckpt" / "policy", tmp_path / "ckpt" / "reference", frozen):
        assert json.loads((d / "nla_injection.json").read_text()) == {"mode": "embed", "layer": None, "scale": None}
    for ckpt in (tmp_path / "ckpt", by_ref):
        fresh = _learner(tiny_dir, lr=1e-2)
        fresh.load(ckpt)
        assert _equal(_adapter(fresh, REFERENCE), ref0) and _equal(_adapter(fresh, POLICY), _adapter(learner, POLICY))
    fresh.update(samples, _adv(len(samples)), vectors)
    assert _equal(_adapter(fresh, REFERENCE), ref0)
    assert all(not p.requires_grad for p in fresh.policy.adapter_parameters(REFERENCE).values())
    # the run directory moves as a whole: the record's path is relative
    (tmp_path / "run").rename(tmp_path / "moved")
    moved = tmp_path / "moved" / "checkpoints" / "ckpt"
    _learner(tiny_dir, lr=1e-2).load(moved)
    # a frozen file that changed (or went) is refused, naming the record and the file
    f = tmp_path / "moved" / "frozen" / "reference" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(NlaInputError, match=r"reference.json: the frozen file it references has changed.*adapter_model"):
        _learner(tiny_dir, lr=1e-2).load(moved)
    f.unlink()
    with pytest.raises(NlaInputError, match="reference.json: the frozen file it references is missing"):
        _learner(tiny_dir, lr=1e-2).load(moved)


def test_nan_loss_leaves_weights_and_optimizer_untouched(tiny_dir, rollouts):
    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir, lr=1e-2)
    learner.update(samples, _adv(len(samples)), vectors)  # optimiser state exists
    weights, opt, version = _adapter(learner), _optimizer_snapshot(learner.optimizer), learner.version
    poisoned = _adv(len(samples))
    poisoned[3] = float("nan")  # (a NaN rollout logprob is masked instead: tests/test_learner_guards.py)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        m = learner.update(samples, poisoned, vectors)
    assert m["skipped"] and not math.isfinite(m["loss"])
    assert _equal(_adapter(learner), weights) and _same_optimizer(_optimizer_snapshot(learner.optimizer), opt)
    assert learner.version == version and all(p.grad is None for p in learner.params)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert learner.update(samples, [float("nan")] + _adv(len(samples))[1:], vectors)["skipped"]
    assert _equal(_adapter(learner), weights)
    assert not learner.update(samples, _adv(len(samples)), vectors)["skipped"]  # and it carries on
    assert learner.version == version + 1


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_identical_to_not_stopping(tiny_dir, rollouts, tmp_path, mode):
    samples, vectors = rollouts[mode]
    adv = _adv(len(samples))
    straight = _learner(tiny_dir, mode, lr=1e-2)
    for _ in range(2):
        straight.update(samples, adv, vectors)
    straight.save(tmp_path / "ckpt")
    rng_at_save = torch.get_rng_state()
    straight.update(samples, adv, vectors)
    torch.manual_seed(99)  # the load must restore the RNG, not inherit this
    resumed = _learner(tiny_dir, mode, lr=1e-2)
    resumed.load(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert (resumed.step, resumed.version) == (2, 3)
    resumed.update(samples, adv, vectors)
    assert _equal(_adapter(resumed), _adapter(straight))
    assert _same_optimizer(_optimizer_snapshot(resumed.optimizer), _optimizer_snapshot(straight.optimizer))
    assert (resumed.step, resumed.version) == (straight.step, straight.version) == (3, 4)


def test_save_is_atomic_and_overwrites(tiny_dir, rollouts, tmp_path):
    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir)
    target = tmp_path / "ckpt"
    learner.save(target)
    learner.update(samples, _adv(len(samples)), vectors)
    learner.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directories left
    assert json.loads((target / "learner_state.json").read_text())["step"] == 1
    assert {p.name for p in (target / "policy").iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "nla_injection.json"}
    with pytest.raises(FileNotFoundError, match="not a learner checkpoint"):
        learner.load(tmp_path)


def test_export_adapter(tiny_dir, rollouts):
    from peft import PeftConfig, get_peft_model_state_dict

    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir, lr=1e-2)
    first = learner.export_adapter()
    assert first.version == 1
    live = get_peft_model_state_dict(learner.model, adapter_name=POLICY)
    assert first.tensors.keys() == live.keys()
    assert all(t.device.type == "cpu" and t.is_contiguous() and torch.equal(t, live[k]) for k, t in first.tensors.items())
    json.dumps(first.peft_config)
    cfg = PeftConfig.from_peft_type(**first.peft_config)
    assert cfg.r == 8 and cfg.lora_alpha == 16 and cfg.use_rslora
    assert not any("embed" in m for m in first.peft_config["target_modules"])
    frozen = {k: t.clone() for k, t in first.tensors.items()}
    learner.update(samples, _adv(len(samples)), vectors)
    second = learner.export_adapter()
    assert second.version == 2
    assert _equal(first.tensors, frozen)  # an export is a copy, not a view of live weights
    assert not _equal(second.tensors, frozen)


def test_packed_export_carries_the_same_adapter(tiny_dir, rollouts):
    from nla_grpo.shared.weight_sync import make_receiver, make_sender

    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir, lr=1e-2)
    learner.update(samples, _adv(len(samples)), vectors)
    plain = learner.export_adapter()
    packed = make_sender("host").export(learner.export_adapter(device="live"))  # what LearnerActor sends
    assert packed.version == plain.version == 2
    assert packed.peft_config == plain.peft_config
    assert _equal(make_receiver("host").receive(packed, "cpu").tensors, plain.tensors)


def test_mismatched_samples_are_masked_out_of_the_loss(tiny_dir, rollouts):
    samples, vectors = rollouts["embed"]
    adv = _adv(len(samples))
    learner = _learner(tiny_dir, lr=1e-2, mismatch_mask_k3=0.5)
    broken = copy.deepcopy(samples)
    broken[2].logprobs = [x - 5.0 for x in broken[2].logprobs]  # as if another adapter had sampled it
    g_masked, stats = _grads(learner, broken, adv, vectors)
    keep = [i for i in range(len(samples)) if i != 2]
    g_without, stats_without = _grads(learner, [samples[i] for i in keep], [adv[i] for i in keep], vectors[keep])
    assert stats["kept"] == len(samples) - 1
    # fp32 rounding only: without the sample the rows pack differently, so sums run in another order
    scale = max(g_without[k].abs().max().item() for k in g_without)
    assert max((g_masked[k] - g_without[k]).abs().max().item() for k in g_masked) <= 1e-5 * max(scale, 1.0)
    assert stats["loss"] == pytest.approx(stats_without["loss"], abs=1e-6)
    with pytest.warns(RuntimeWarning, match="1/6 samples masked"):
        m = learner.update(broken, adv, vectors)
    assert m["masked"] == 1 and m["logprob_mismatch_k3"] > learner.cfg.learner.mismatch_mask_k3 / len(samples)


def test_empty_responses_are_ignored(tiny_dir, rollouts):
    samples, vectors = rollouts["karvonen"]
    adv = _adv(len(samples))
    learner = _learner(tiny_dir, "karvonen", lr=1e-2)
    learner.update(samples, adv, vectors)
    empty = copy.deepcopy(samples[0])
    empty.response_ids, empty.logprobs = [], []
    g_ref, _ = _grads(learner, samples, adv, vectors)
    g_with, _ = _grads(learner, [empty] + samples, [5.0] + adv, torch.cat([vectors[:1], vectors]))
    assert max((g_ref[k] - g_with[k]).abs().max().item() for k in g_ref) <= 1e-7
    assert learner.logprobs([empty], vectors[:1]) == [[]]
    m = learner.update([empty], [1.0], vectors[:1])
    assert m["skipped"] and learner.version == 2


def test_ppo_epochs_recompute_old_logprobs_and_take_several_steps(tiny_dir, rollouts):
    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir, ppo_epochs=3, lr=1e-2)
    m = learner.update(samples, _adv(len(samples)), vectors)
    assert not m["skipped"] and learner.step == 3 and learner.version == 4
    assert m["logprob_mismatch_mean_abs"] < 1e-5
    assert m["clip_frac"] > 0  # later epochs see the policy move away from the recomputed old logprobs


@pytest.mark.parametrize("mode", MODES)
def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir, rollouts, mode):
    samples, vectors = rollouts[mode]
    adv = _adv(len(samples))
    plain = _learner(tiny_dir, mode)
    ckpt = _learner(tiny_dir, mode, gradient_checkpointing=True)
    assert ckpt.model.base_model.model.is_gradient_checkpointing
    g_plain, _ = _grads(plain, samples, adv, vectors)
    g_ckpt, _ = _grads(ckpt, samples, adv, vectors)
    assert max((g_plain[k] - g_ckpt[k]).abs().max().item() for k in g_plain) <= 1e-6


def test_bad_inputs_are_clear_errors(tiny_dir, rollouts):
    samples, vectors = rollouts["embed"]
    learner = _learner(tiny_dir)
    with pytest.raises(ValueError, match="vectors: expected"):
        learner.update(samples, _adv(len(samples)), vectors[:2])
    with pytest.raises(ValueError, match="advantages: expected"):
        learner.update(samples, [1.0], vectors)
    bad = copy.deepcopy(samples)
    bad[1].logprobs = bad[1].logprobs + [-1.0]
    with pytest.raises(ValueError, match="logprobs"):
        learner.update(bad, _adv(len(samples)), vectors)
    with pytest.raises(ValueError, match="adapter"):
        learner.logprobs(samples, vectors, "base")


def test_actor_class_is_built_lazily():
    import subprocess
    import sys

    import nla_grpo.learner.actor as actor_module
    from conftest import ROOT
    from nla_grpo.shared.actors import remote

    for method in ("update", "logprobs", "export_adapter", "save", "load"):
        assert hasattr(actor_module.LearnerActor, method)
    cls = remote(actor_module.LearnerActor)
    assert hasattr(cls, "options") and hasattr(cls, "remote") and remote(actor_module.LearnerActor) is cls
    # the actor modules themselves import neither Ray nor torch
    probe = ("import sys, learner.actor, rollout.actor, critic.actor; "
             "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_adapter_init_from_a_peft_directory_sets_policy_and_reference(tiny_dir, rollouts, tmp_path):
    samples, vectors = rollouts["embed"]
    trained = _learner(tiny_dir, lr=1e-2)
    trained.update(samples, _adv(len(samples)), vectors)
    trained.save(tmp_path / "ckpt")  # its policy/ subdirectory is a plain PEFT adapter directory
    learner = _learner(tiny_dir, adapter_init=str(tmp_path / "ckpt" / "policy"))
    assert _equal(_adapter(learner, POLICY), _adapter(trained, POLICY))
    assert _equal(_adapter(learner, REFERENCE), _adapter(trained, POLICY))
    assert {n for n, p in learner.model.named_parameters() if p.requires_grad} == {
        n for n in dict(learner.model.named_parameters()) if f".{POLICY}." in n and "lora_" in n}
    assert learner.logprobs(samples, vectors) == trained.logprobs(samples, vectors)


def test_a_reference_adapter_given_apart_from_the_policys_start(tiny_dir, rollouts, tmp_path):
    """learner.reference_adapter: the KL anchor is that adapter, frozen, while the policy starts from
    adapter_init (a resumed reference-trainer run); the same content given twice is warned about."""
    samples, vectors = rollouts["embed"]
    sft = _learner(tiny_dir, lr=1e-2)
    sft.save(tmp_path / "sft")
    moved = _learner(tiny_dir, lr=1e-2, adapter_init=str(tmp_path / "sft" / "policy"))
    moved.update(samples, _adv(len(samples)), vectors)
    moved.save(tmp_path / "iter")
    learner = _learner(tiny_dir, adapter_init=str(tmp_path / "iter" / "policy"), reference_adapter=str(tmp_path / "sft" / "policy"))
    assert _equal(_adapter(learner, POLICY), _adapter(moved, POLICY))
    assert _equal(_adapter(learner, REFERENCE), _adapter(sft, POLICY)) and not _equal(_adapter(learner, REFERENCE), _adapter(moved, POLICY))
    assert all(not p.requires_grad for p in learner.policy.adapter_parameters(REFERENCE).values())
    # the reference forward is the SFT adapter's: its logprobs are the SFT learner's own
    assert learner.logprobs(samples, vectors, REFERENCE) == sft.logprobs(samples, vectors)
    import shutil
    shutil.copytree(tmp_path / "iter" / "policy", tmp_path / "same")
    with pytest.warns(RuntimeWarning, match="the policy starts identical to it"):
        _learner(tiny_dir, adapter_init=str(tmp_path / "iter" / "policy"), reference_adapter=str(tmp_path / "same"))


def test_truncated_importance_weights_scale_the_update(tiny_dir, rollouts):
    """grpo.tis_cap: with the rollout's logprobs equal to the learner's the gradient is the plain one and
    every weight 1; with each rollout token 4x likelier than the learner finds it, every weight is 1/4
    and (KL off) so is the gradient; with each 4x rarer, every weight is the cap, 2."""
    import dataclasses

    samples, vectors = rollouts["embed"]
    adv = _adv(len(samples))
    plain = _learner(tiny_dir)
    plain.cfg = plain.cfg.model_copy(update={"grpo": plain.cfg.grpo.model_copy(update={"kl_beta": 0.0})})
    own = [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, plain.logprobs(samples, vectors))]
    g_plain, _ = _grads(plain, own, adv, vectors)
    tis = _learner(tiny_dir)
    tis.cfg = tis.cfg.model_copy(update={"grpo": tis.cfg.grpo.model_copy(update={"kl_beta": 0.0, "tis_cap": 2.0})})
    g_one, s_one = _grads(tis, own, adv, vectors)
    assert abs(s_one["tis/weight_mean"] - 1.0) < 1e-6 and s_one["tis/capped_frac"] == 0.0
    assert all(torch.allclose(g_one[k], g_plain[k], atol=1e-7) for k in g_plain)
    likelier = [dataclasses.replace(s, logprobs=[x + math.log(4.0) for x in s.logprobs]) for s in own]
    g_quarter, s_quarter = _grads(tis, likelier, adv, vectors)
    assert abs(s_quarter["tis/weight_mean"] - 0.25) < 1e-5
    assert all(torch.allclose(g_quarter[k], g_one[k] / 4, atol=1e-7) for k in g_one)
    assert max(float(g.abs().max()) for g in g_one.values()) > 1e-4  # the comparison is not of zeros
    rarer = [dataclasses.replace(s, logprobs=[x - math.log(4.0) for x in s.logprobs]) for s in own]
    g_capped, s_capped = _grads(tis, rarer, adv, vectors)
    assert s_capped["tis/capped_frac"] == 1.0 and abs(s_capped["tis/weight_mean"] - 2.0) < 1e-6
    assert all(torch.allclose(g_capped[k], 2 * g_one[k], atol=1e-7) for k in g_one)
