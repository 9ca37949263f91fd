"""learner.kernels: fused decoder kernels keep the eager update's gradients (compile on the CPU here,
liger on a GPU in the GPU test below), and the kinds a device cannot run are refused in one line."""
import pytest
import torch

from learner import kernels
from learner.learner import Learner
from test_learner_service import _adv, _grads
from test_learner_support import load_tiny_spec, make_cfg, sample_responses

MODES = ("embed", "karvonen")


@pytest.fixture(scope="module")
def rollouts(tiny_dir):
    return {mode: sample_responses(tiny_dir, mode, n_prompts=3, group=4, max_new=7) for mode in MODES}


def _gradients(tiny_dir, rollouts, mode, device="cpu", **learner):
    samples, vectors = rollouts[mode]
    cfg = make_cfg(tiny_dir, mode, "cpu" if device == "cpu" else "colocated", lr=1e-2, mismatch_mask_k3=1e6,
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


def test_liger_on_a_cpu_placement_is_refused_in_one_line(tiny_dir):
    from shared.config import build_config, cross_field_problems

    from shared.errors import NlaInputError

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
    _, want, s_want = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="none")
    model, got, s_got = _gradients(tiny_dir, rollouts, mode, "cuda", kernels="liger")
    assert model.policy.kernels == "liger"
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    assert s_got["loss"] == pytest.approx(s_want["loss"], abs=1e-6)
