"""The packed update (shared-prefix rows, fused LoRA, chunked head) against the padded one on the tiny model (fp32)."""
import pytest

from nla_grpo.learner.policy import POLICY, REFERENCE
from nla_grpo.learner.learner import Learner
from test_learner_service import _adv, _grads
from test_learner_support import load_tiny_spec, make_cfg, sample_responses

MODES = ("embed", "karvonen")


@pytest.fixture(scope="module")
def uneven(tiny_dir):
    """Per mode: 3 prompts × 4 samples of 1 to 7 tokens."""
    return {mode: sample_responses(tiny_dir, mode, n_prompts=3, group=4, max_new=7) for mode in MODES}


def _moved_learner(tiny_dir, samples, vectors, mode, **kw):
    """A learner whose policy is off its initial adapter (B != 0), so LoRA, reference and KL all matter."""
    learner = Learner(make_cfg(tiny_dir, mode, lr=1e-2, mismatch_mask_k3=1e6, **kw), load_tiny_spec(tiny_dir))
    assert learner.policy.packed
    learner.update(samples, _adv(len(samples)), vectors)
    return learner


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_and_padded_give_the_same_loss_and_gradients(tiny_dir, uneven, mode, checkpointing):
    samples, vectors = uneven[mode]
    assert len({len(s.response_ids) for s in samples}) > 3  # uneven lengths inside each group
    learner = _moved_learner(tiny_dir, samples, vectors, mode, micro_batch=8, gradient_checkpointing=checkpointing)
    adv = _adv(len(samples))
    g_packed, s_packed = _grads(learner, samples, adv, vectors)
    learner.policy.use_forward("padded")
    g_padded, s_padded = _grads(learner, samples, adv, vectors)
    assert all(g_padded[k].abs().max() > 0 for k in g_padded)
    assert max((g_packed[k] - g_padded[k]).abs().max().item() for k in g_padded) <= 1e-5
    assert s_packed["loss"] == pytest.approx(s_padded["loss"], abs=1e-5)
    assert s_packed["kl_mean"] == pytest.approx(s_padded["kl_mean"], rel=1e-6) and s_packed["kl_mean"] > 0
    for adapter in (POLICY, REFERENCE):
        learner.policy.use_forward("padded")
        want = learner.logprobs(samples, vectors, adapter)
        learner.policy.use_forward("packed")
        got = learner.logprobs(samples, vectors, adapter)
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) <= 1e-5


def test_packing_shares_each_prompt_once(tiny_dir, uneven):
    from nla_grpo.learner.micro_batches import items_from as _items

    samples, vectors = uneven["embed"]
    learner = Learner(make_cfg(tiny_dir, "embed", micro_batch=8), load_tiny_spec(tiny_dir))
    batches = [b for _, b in learner.micro_batches_of(_items(samples, vectors))]
    assert sum(b.input_ids.shape[0] for b in batches) == 3  # one row per prompt
    assert sum(len(b.members) for b in batches) == len(samples)
    assert sum(b.processed for b in batches) < sum(b.tokens for b in batches)
    assert sorted(i for b in batches for i in b.members) == list(range(len(samples)))


def test_auto_micro_batch_is_chosen_once_reported_and_kept_on_resume(tiny_dir, uneven, tmp_path):
    from nla_grpo.learner.memory_plan import CPU_MAX_TOKENS

    samples, vectors = uneven["embed"]
    learner = Learner(make_cfg(tiny_dir, "embed", micro_batch="auto", lr=1e-2, mismatch_mask_k3=1e6), load_tiny_spec(tiny_dir))
    assert learner.planned_tokens() == (CPU_MAX_TOKENS, None)  # what it would plan now; nothing kept yet
    m = learner.update(samples, _adv(len(samples)), vectors)
    assert m["learner/micro_batch_tokens"] == learner.micro_batch_tokens == CPU_MAX_TOKENS
    assert learner.planned_tokens() == (CPU_MAX_TOKENS, CPU_MAX_TOKENS)
    assert m["learner/tokens_per_s"] > 0 and m["learner/tflops_effective"] > 0
    assert m["learner/tflops_effective"] * 1e12 / m["learner/tokens_per_s"] == pytest.approx(6 * learner.base_params, rel=1e-6)
    assert learner.base_params == sum(p.numel() for n, p in learner.model.named_parameters() if "lora_" not in n)
    learner.micro_batch_tokens = 4096  # as if another machine had chosen it
    learner.save(tmp_path / "ckpt")
    fresh = Learner(make_cfg(tiny_dir, "embed", micro_batch="auto", lr=1e-2), load_tiny_spec(tiny_dir))
    fresh.load(tmp_path / "ckpt")
    assert fresh.micro_batch_tokens == 4096
    assert fresh.planned_tokens() == (CPU_MAX_TOKENS, 4096)  # a resumed run's budget, beside what memory allows now


@pytest.mark.parametrize("kernels,attention,counted", [("none", "sdpa", (False, "sdpa")), ("compile", "sdpa", (True, "sdpa")),
                                                     ("none", "varlen", (False, "varlen"))])
def test_the_auto_budget_counts_what_the_kernels_keep(tiny_dir, monkeypatch, kernels, attention, counted):
    from nla_grpo.learner import memory_plan

    seen = []
    monkeypatch.setattr(memory_plan, "plan_tokens", lambda *a, **k: seen.append((k["fused"], k["attention"])) or 4096)
    learner = Learner(make_cfg(tiny_dir, "embed", micro_batch="auto", kernels=kernels, attention=attention),
                      load_tiny_spec(tiny_dir))
    assert learner.planned_tokens() == (4096, None)  # planned, not kept
    assert learner.micro_batches.token_budget(learner.params, learner.optimizer) == 4096 and seen == [counted, counted]
    assert learner.micro_batch_tokens == 4096


def test_a_token_budget_splits_a_group_and_keeps_the_gradient(tiny_dir, uneven):
    samples, vectors = uneven["embed"]
    learner = _moved_learner(tiny_dir, samples, vectors, "embed", micro_batch="auto")
    adv = _adv(len(samples))
    g_whole, _ = _grads(learner, samples, adv, vectors)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    learner.micro_batch_tokens = longest + 2  # rows of about one sample each
    from nla_grpo.learner.micro_batches import items_from as _items

    assert sum(b.input_ids.shape[0] for _, b in learner.micro_batches_of(_items(samples, vectors))) > 3
    g_split, _ = _grads(learner, samples, adv, vectors)
    assert max((g_whole[k] - g_split[k]).abs().max().item() for k in g_whole) <= 1e-5


def test_the_packed_forward_refuses_attention_it_cannot_mask(tiny_dir):
    from nla_grpo.learner.policy import _check_packable

    class Cfg:
        _attn_implementation = "flash_attention_2"

    with pytest.raises(ValueError, match="learner.forward packed: expected sdpa or eager"):
        _check_packable(Cfg())
    Cfg._attn_implementation, Cfg.final_logit_softcapping = "sdpa", 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        _check_packable(Cfg())


def test_an_integer_micro_batch_never_holds_more_tokens_than_its_padded_samples(tiny_dir, uneven):
    from nla_grpo.learner.micro_batches import items_from as _items

    samples, vectors = uneven["embed"]
    learner = Learner(make_cfg(tiny_dir, "embed", micro_batch=2), load_tiny_spec(tiny_dir))
    items = _items(samples, vectors)
    longest = max(len(it.prompt_ids) + len(it.response_ids) for it in items)
    batches = [b for _, b in learner.micro_batches_of(items)]
    assert all(len(b.members) <= 2 or b.input_ids.shape[0] == 1 for b in batches)
    assert all(b.processed <= 2 * longest for b in batches)
    assert sorted(i for b in batches for i in b.members) == list(range(len(samples)))


def test_packed_refuses_sliding_windows_and_scaled_logits():
    from nla_grpo.learner.policy import _check_packable

    class Qwen2Like:
        _attn_implementation, use_sliding_window, sliding_window = "sdpa", True, 4096

    class Granite:
        _attn_implementation, logits_scaling = "sdpa", 8.0

    with pytest.raises(ValueError, match="sliding-window attention"):
        _check_packable(Qwen2Like())
    with pytest.raises(ValueError, match="logits_scaling"):
        _check_packable(Granite())
    Qwen2Like.use_sliding_window = False
    _check_packable(Qwen2Like())  # the window off: nothing to apply


def test_a_run_saved_before_the_packed_update_resumes_on_the_padded_one(tiny_dir, tmp_path):
    import yaml

    from nla_grpo.orchestrator.run_dir import RunDir
    from nla_grpo.shared.config import build_config, dump_config

    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")}}, "t")
    raw = yaml.safe_load(dump_config(cfg))
    del raw["learner"]["forward"]  # as the earlier code wrote it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    assert RunDir.open(tmp_path).config(["grpo.steps=5"]).learner.forward == "padded"
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert RunDir.open(tmp_path).config().learner.forward == "packed"


@pytest.mark.parametrize("forward,epochs", [("packed", 1), ("padded", 1), ("packed", 2)])
def test_executed_flops_count_the_tokens_the_forwards_ran(tiny_dir, uneven, forward, epochs):
    """learner/tflops_executed counts each prompt once (packed), no padding, and the rescoring pass."""
    from nla_grpo.learner.micro_batches import items_from as _items
    from nla_grpo.learner.update_metrics import executed_tokens

    samples, vectors = uneven["embed"]
    learner = Learner(make_cfg(tiny_dir, "embed", micro_batch=8, forward=forward, ppo_epochs=epochs, lr=1e-2,
                               mismatch_mask_k3=1e6), load_tiny_spec(tiny_dir))
    items = _items(samples, vectors)
    per_pass = sum(executed_tokens(b) for _, b in learner.micro_batches_of(items))
    logical = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    m = learner.update(samples, _adv(len(samples)), vectors)
    # rescoring (epochs > 1) runs the same micro-batches once more, forward only
    assert m["learner/executed_tokens"] == per_pass * (epochs + (1 if epochs > 1 else 0))
    if forward == "packed":
        assert per_pass < logical  # each group's prompt ran once
    else:
        assert per_pass == logical  # every sample's own tokens, the padding left out
    seconds = logical * epochs / m["learner/tokens_per_s"]
    want = (6 * per_pass * epochs + (2 * per_pass if epochs > 1 else 0)) * learner.base_params / seconds / 1e12
    assert m["learner/tflops_executed"] == pytest.approx(want, rel=1e-6)
