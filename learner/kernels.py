"""Fused kernels for the learner's decoder (``learner.kernels``), applied to one loaded model instance.

A profile of the packed update on an H200 (``benchmarks/results/h200-learner-profile*.txt``) spends
about a third of its GPU time outside the GEMMs: RMSNorm with its fp32 casts, RoPE, SiLU·mul, residual
adds, each a separate elementwise kernel forward and backward. Two ways to fuse them:

- ``liger``: liger-kernel's Triton RMSNorm (every norm, Qwen3's per-head q/k norms too), RoPE and
  SwiGLU, patched onto this instance only (the LoRA linears, attention and the LM head untouched).
  Triton on CUDA only. liger's RoPE is installed in the modelling module of the model's family, so
  it serves every model of that family in this process (the same maths).
- ``compile``: each decoder layer compiled by ``torch.compile`` (regional: one layer's graph, reused
  by all, dynamic sequence lengths), which fuses the same elementwise chains and the LoRA scaling.
- ``none``: eager PyTorch.

``auto`` takes ``liger`` on a CUDA device when liger-kernel imports, ``none`` elsewhere. All keep the
arithmetic of the eager forward up to rounding: tests compare gradients against ``none``.
"""
from __future__ import annotations

import importlib.util

import torch

KINDS = ("auto", "none", "liger", "compile")
LIGER_FAMILIES = ("qwen3", "qwen2", "llama")  # the families whose liger patch keeps the packed forward's maths


def resolve(kind: str, device: torch.device) -> str:
    """The kernels ``kind`` means on ``device``: ``auto`` picks, the others must be possible."""
    if kind == "auto":
        return "liger" if device.type == "cuda" and importlib.util.find_spec("liger_kernel") else "none"
    if kind == "liger":
        if device.type != "cuda":
            raise ValueError("learner.kernels=liger: liger-kernel's Triton kernels need a CUDA device; use none or compile")
        if importlib.util.find_spec("liger_kernel") is None:
            raise ValueError("learner.kernels=liger: liger-kernel is not installed (pip install liger-kernel)")
    return kind


def install(model, kind: str) -> None:
    """Apply resolved ``kind`` to the PEFT ``model`` (in place)."""
    base = model.get_base_model()
    if kind == "liger":
        family = base.config.model_type
        if family not in LIGER_FAMILIES:
            raise ValueError(f"learner.kernels=liger: no liger patch for model type {family!r} "
                             f"(supported: {', '.join(LIGER_FAMILIES)}); use compile or none")
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        # the LM head keeps this project's chunked logprobs: no fused cross-entropy
        _apply_liger_kernel_to_instance(base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    elif kind == "compile":
        for layer in base.get_decoder().layers:
            layer.compile(dynamic=True)
    elif kind != "none":
        raise ValueError(f"learner.kernels: expected one of {', '.join(KINDS)}, found {kind!r}")
