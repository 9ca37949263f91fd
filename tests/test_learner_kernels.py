"""learner.kernels: fused decoder kernels keep the eager update's gradients (compile on the CPU here,
liger on a GPU in the GPU test below), and the kinds a device cannot run are refused in one line."""
import pytest
import torch

from nla_grpo.learner import kernels
from nla_grpo.learner.learner import Learner
from test_learner_service import _adv, _grads
from test_learner_support import load_tiny_spec, make_cfg, sample_responses

MODES = ("embed", "karvonen")


@pytest.fixture(scope="module")
def rollouts(tiny_dir):
    return {mode: sample_responses(tiny_dir, mode, n_prompts=3, group=4, max_new=7) for mode in MODES}


def _gradients(tiny_dir, rollouts, mode, device="cpu", dtype="float32", **learner):
    samples, vectors = rollouts[mode]
    cfg = make_cfg(tiny_dir, mode, "cpu" if device == "cpu" else "colocated", dtype=dtype, lr=1e-2, mismatch_mask_k3=1e6,
                   micro_batch=8, **learner)
    model = Learner(cfg, load_tiny_spec(tiny_dir), device)
    model.update(samples, _adv(len(samples)), vectors)  # off the initial adapter: LoRA B != 0
    grads, stats = _grads(model, samples, _adv(len(samples)), vectors)
    return model, {k: g.cpu() for k, g in grads.items()}, stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_compiled_layers_give_the_eager_gradients(tiny_dir, rollouts, mode):
    _, want, s_want = _gradients(tiny_dir, rollouts, mode, kernels="none")
    model, got, s_got = _gradients(tiny_dir, rollouts, mode, kernels="compile")
    assert model.policy.kernels == "compile"
    assert all(want[k].abs().max() > 0 for k in want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    assert s_got["loss"] == pytest.approx(s_want["loss"], abs=1e-6)


def test_kernel_kinds_resolve_by_device():
    cpu = torch.device("cpu")
    assert kernels.resolve("auto", cpu) == "none"  # the CPU path stays eager
    assert kernels.resolve("compile", cpu) == "compile"
    with pytest.raises(ValueError, match="learner.kernels=liger: .*CUDA"):
        kernels.resolve("liger", cpu)


def test_a_liger_rope_left_installed_keeps_cpu_models_of_the_family_eager(tiny_dir, monkeypatch):
    """liger's RoPE is a module-level function: after a GPU model installs it, a CPU model of the same family in
    the process (a reader's critic) must still compute RoPE eagerly, not hand CPU tensors to a Triton kernel."""
    import sys
    import types

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    eager = modeling_qwen3.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", eager)  # restored after the test
    monkeypatch.setattr(kernels, "_EAGER_ROPE", {})

    def fused(*args, **kwargs):
        raise AssertionError("the CUDA-only RoPE ran on CPU tensors")

    def apply(base, **kwargs):  # what liger's instance patch does to the modelling module
        modeling_qwen3.apply_rotary_pos_emb = fused

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake._apply_liger_kernel_to_instance = apply
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    want = base(input_ids=ids).logits
    kernels.install(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])), "liger")
    installed = modeling_qwen3.apply_rotary_pos_emb
    assert installed is not eager and installed.fused is fused and installed.eager is eager
    other = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    torch.testing.assert_close(other(input_ids=ids).logits, want)  # the CPU model ran, eagerly
    kernels.install(get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"])), "none")
    assert modeling_qwen3.apply_rotary_pos_emb is eager


def test_liger_on_a_cpu_placement_is_refused_in_one_line(tiny_dir):
    from nla_grpo.shared.config import build_config, cross_field_problems

    from nla_grpo.shared.errors import NlaInputError

    with pytest.raises(NlaInputError, match="learner.kernels=liger: liger-kernel's Triton kernels need CUDA GPUs"):
        make_cfg(tiny_dir, "embed", kernels="liger")
    cfg = build_config({"placement": {"mode": "colocated"}, "learner": {"kernels": "liger"},
                        "model": {"path": str(tiny_dir / "model"), "dtype": "bfloat16"},
                        "data": {"parquet": str(tiny_dir / "rl.parquet")}}, "test")
    assert not [p for p in cross_field_problems(cfg) if "kernels" in p]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_liger_kernels_give_the_eager_gradients_on_the_gpu(tiny_dir, rollouts, mode):
    """fp32 on the GPU, so the comparison sees the kernels' maths and not bf16 rounding."""
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen3 import modeling_qwen3

    eager_rope = modeling_qwen3.apply_rotary_pos_emb
    model, got, s_got = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="liger")
    assert model.policy.kernels == "liger" and modeling_qwen3.apply_rotary_pos_emb is not eager_rope
    # built after the liger one, in the same process: eager all through (liger's class swaps undone)
    plain, want, s_want = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="none")
    assert modeling_qwen3.apply_rotary_pos_emb is eager_rope
    norms = [m for m in plain.model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert norms and not any("forward" in vars(m) for m in norms)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    assert s_got["loss"] == pytest.approx(s_want["loss"], abs=1e-6)


# ---- learner.attention: flex (FlexAttention's block mask instead of the dense one) --------------------
def test_the_block_mask_allows_what_the_dense_mask_allows():
    from torch.nn.attention.flex_attention import create_mask

    from nla_grpo.learner.packed_attention import block_mask
    from nla_grpo.learner.packing import segment_mask

    # two rows: a prompt of 5 with responses of 3 and 4, then pads; a prompt of 7 with one of 2
    seg = torch.full((2, 16), -2, dtype=torch.long)
    seg[0, :5], seg[0, 5:8], seg[0, 8:12] = -1, 0, 1
    seg[1, :7], seg[1, 7:9] = -1, 2
    dense = segment_mask(seg)
    flex = create_mask(block_mask(seg).mask_mod, 2, 1, 16, 16, device="cpu")
    assert torch.equal(flex, dense)
    assert not dense[0, 0, 9, 6]  # response 1 never sees response 0


@pytest.mark.parametrize("mode", MODES)
def test_flex_attention_scores_what_the_dense_mask_scores(tiny_dir, rollouts, mode):
    """Forward only: FlexAttention has no backward on the CPU (the GPU test compares gradients)."""
    from nla_grpo.learner.policy import POLICY

    samples, vectors = rollouts[mode]
    want = Learner(make_cfg(tiny_dir, mode, micro_batch=8, attention="sdpa"), load_tiny_spec(tiny_dir))
    got = Learner(make_cfg(tiny_dir, mode, "colocated", micro_batch=8, attention="flex"), load_tiny_spec(tiny_dir))
    assert got.policy.attention == "flex" and want.policy.attention == "sdpa"
    a, b = got.logprobs(samples, vectors, POLICY), want.logprobs(samples, vectors, POLICY)
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_flex_attention_gives_the_dense_masks_gradients_on_the_gpu(tiny_dir, rollouts, mode):
    _, want, s_want = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="none", attention="sdpa")
    model, got, s_got = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="none", attention="flex")
    assert model.policy.attention == "flex"
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    assert s_got["loss"] == pytest.approx(s_want["loss"], abs=1e-6)
