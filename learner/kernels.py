"""Fused kernels for the learner's decoder (``learner.kernels``), applied to one loaded model instance.

A profile of the packed update on a GPU spends
about a third of its GPU time outside the GEMMs: RMSNorm with its fp32 casts, RoPE, SiLU·mul, residual
adds, each a separate elementwise kernel forward and backward. Two ways to fuse them:

- ``liger``: liger-kernel's Triton RMSNorm (every norm, Qwen3's per-head q/k norms too), RoPE and
  SwiGLU, patched onto this instance only (the LoRA linears, attention and the LM head untouched).
  Triton on CUDA only. liger also swaps the family's classes in transformers' modelling module; those
  swaps are undone, so models built later are eager. Its RoPE, a module-level function that attention
  calls, stays installed until a ``none`` or ``compile`` install in the same process puts the eager one back;
  meanwhile it runs liger's kernel on CUDA tensors only, so a model of the family on the CPU in the same
  process (a reader's or a test's critic) still computes its RoPE eagerly.
- ``compile``: each decoder layer compiled by ``torch.compile`` (regional: one layer's graph, reused
  by all, dynamic sequence lengths), which fuses the same elementwise chains and the LoRA scaling.
- ``none``: eager PyTorch.

``auto`` takes ``liger`` on a CUDA device when liger-kernel imports, ``none`` elsewhere. All keep the
arithmetic of the eager forward up to rounding: tests compare gradients against ``none``.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

_EAGER_ROPE: dict = {}  # family -> transformers' own apply_rotary_pos_emb, while liger's is installed

KINDS = ("auto", "none", "liger", "compile")
FUSED = ("liger", "compile")  # the kinds whose norms and SwiGLU keep less for backward (learner.memory_plan)
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


def cuda_only(fused, eager):
    """``fused`` (a Triton kernel) for CUDA tensors, ``eager`` for any other: what a module-level function
    patched for one model must do for every other model of its family in the process."""

    def rope(q, k, *args, **kwargs):
        return (fused if q.is_cuda else eager)(q, k, *args, **kwargs)

    rope.fused, rope.eager = fused, eager
    return rope


def install(model, kind: str) -> None:
    """Apply resolved ``kind`` to the PEFT ``model`` (in place)."""
    base = model.get_base_model()
    family = base.config.model_type

    def modelling():
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    if kind != "liger" and family in _EAGER_ROPE:  # liger's RoPE from an earlier model in this process
        modelling().apply_rotary_pos_emb = _EAGER_ROPE.pop(family)
    if kind == "liger":
        if family not in LIGER_FAMILIES:
            raise ValueError(f"learner.kernels=liger: no liger patch for model type {family!r} "
                             f"(supported: {', '.join(LIGER_FAMILIES)}); use compile or none")
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        module = modelling()
        before = dict(vars(module))
        # the LM head keeps this project's chunked logprobs: no fused cross-entropy
        _apply_liger_kernel_to_instance(base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
        for name, value in before.items():
            if vars(module).get(name) is not value:
                if name == "apply_rotary_pos_emb":
                    _EAGER_ROPE.setdefault(family, value)
                    setattr(module, name, cuda_only(vars(module)[name], _EAGER_ROPE[family]))
                else:  # a class swap: later models of this family are built eager
                    setattr(module, name, value)
    elif kind == "compile":
        for layer in base.get_decoder().layers:
            layer.compile(dynamic=True)
    elif kind != "none":
        raise ValueError(f"learner.kernels: expected one of {', '.join(KINDS)}, found {kind!r}")
