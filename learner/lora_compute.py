"""LoRA layers that compute in the base model's dtype while their weights (and optimiser) stay fp32.

PEFT keeps adapter weights in fp32 on a bf16 base (``autocast_adapter_dtype``) and then casts each
layer's *input* to fp32, so every LoRA matmul of the 7 adapted linears runs in fp32, forward and
backward, twice per micro-batch (policy and reference). On a GPU that made an r=128 policy pass
73% slower than the bare base for ~5% more FLOPs. Here the small adapter matrices are cast to the
activations' dtype instead (their gradient flows back through the cast into the fp32 weights), and
the update is one fused ``addmm`` into the base output: ``y = base(x) + s·(x Aᵀ) Bᵀ``.

Over a dense base (``nn.Linear``) the order is turned round: the LoRA term first, ``t = (x Aᵀ)(s·B)ᵀ`` (+ the
bias), then the base GEMM accumulates onto it in place, ``t += x Wᵀ`` (GEMM with beta = 1, the read of ``t``
inside the GEMM's epilogue). ``addmm(base(x), x Aᵀ, Bᵀ)`` out of place first copies ``base(x)`` into a new
tensor and then reads and writes it again: the output written three times and read twice, against twice and
once here. In a profile of the 8B update
those copies and addmms took 2.5% + 6.8% of the GPU's time for about 2% of the FLOPs.
``ACCUMULATE_IN_BASE = False`` keeps the earlier order (the benchmark's A/B).

In fp32 (the CPU path) this is the same arithmetic as PEFT's up to the order of the sums. Layers PEFT would
treat specially (DoRA and other variants, dropout, a LoRA bias, merged weights, mixed-adapter batches) keep
PEFT's own forward.

Inside ``reusing_casts()`` (the learner's update and scoring) each adapter matrix is cast, scaled and
transposed once and reused by every micro-batch until the weight changes (its version, which the optimiser's
in-place step moves): an adapted linear then dispatches 5 ops per forward instead of 11. Those small ops cost
the GPU nothing but each costs the host its dispatch, and with 7 linears x 36 layers x 2 forwards (policy and
reference) per micro-batch the host, not the GPU, set the pace of short stretches of the update. A cast made
with gradients on is reused only with gradients on: each micro-batch's backward passes through the same cast
into the fp32 weight's gradient (the cast keeps no tensors for backward, so it can be passed again).
"""
from __future__ import annotations

import contextlib
import types

import torch


# PEFT's LoRA classes over a dense, 4-bit or 8-bit linear: their forward is base(x) + the LoRA term
LINEAR_CLASSES = ("Linear", "Linear4bit", "Linear8bitLt")
ACCUMULATE_IN_BASE = True  # a dense base's GEMM adds itself onto the LoRA term (module doc string)
_CASTS: dict | None = None  # reusing_casts()'s cache: key -> (weight, its version, the transposed cast)


@contextlib.contextmanager
def reusing_casts():
    """Within: each adapter matrix's cast (and the frozen base weight's transpose) is made once and reused while
    the weight is unchanged; all dropped on exit. Nests (the outermost one clears)."""
    global _CASTS
    outer = _CASTS is None
    if outer:
        _CASTS = {}
    try:
        yield
    finally:
        if outer:
            _CASTS = None


class _Scaled(torch.autograd.Function):
    """``w · s`` for a float ``s``, keeping no tensor for backward (autograd's own product keeps ``s`` as a
    tensor and frees it after one backward), so every micro-batch's backward can pass through the one node."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, s: float) -> torch.Tensor:
        ctx.s = s
        return w * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.s, None


def _transposed(weight: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``(scale · weight).to(dtype).t()``, from ``reusing_casts()``'s cache when it holds one for this weight as it
    is now, made with gradients on exactly when they are on now."""
    if torch.compiler.is_compiling() or _CASTS is None:  # a compiled layer fuses the casts (no guard on the cache)
        return (weight if scale == 1.0 else weight * scale).to(dtype).t()

    key = (id(weight), dtype, scale, torch.is_grad_enabled())
    hit = _CASTS.get(key)
    if hit is not None and hit[0] is weight and hit[1] == weight._version:
        return hit[2]
    out = (weight if scale == 1.0 else _Scaled.apply(weight, scale)).to(dtype).t()
    _CASTS[key] = (weight, weight._version, out)
    return out


def _dense_base_onto_lora(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
    """``base(x) + Σ s·(x Aᵀ) Bᵀ`` over a ``nn.Linear`` base in ``x``'s dtype: the LoRA terms (and the
    bias) first, then the base GEMM accumulated onto them in place."""
    base = self.base_layer
    flat = x.reshape(-1, x.shape[-1])
    out = None
    for name in active:
        a_t = _transposed(self.lora_A[name].weight, x.dtype)
        b_t = _transposed(self.lora_B[name].weight, x.dtype, self.scaling[name])  # s folded into the small matrix
        xa = flat @ a_t
        if out is None:
            out = torch.addmm(base.bias, xa, b_t) if base.bias is not None else xa @ b_t
        else:
            out = out.addmm_(xa, b_t)
    out = out.addmm_(flat, _transposed(base.weight, x.dtype))
    return out.view(*x.shape[:-1], out.shape[-1])


def _fast_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    active = [a for a in self.active_adapters if a in self.lora_A]
    if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None or self.lora_variant
            or any(not isinstance(self.lora_dropout[a], torch.nn.Identity) for a in active)
            or any(getattr(self, "lora_bias", {}).get(a, False) for a in active)):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    if (ACCUMULATE_IN_BASE and active and type(base) is torch.nn.Linear and not args and not kwargs
            and x.dtype == base.weight.dtype):
        return _dense_base_onto_lora(self, x, active)
    result = base(x, *args, **kwargs)
    dtype = result.dtype
    flat = x.reshape(-1, x.shape[-1]).to(dtype)
    out = result.reshape(-1, result.shape[-1])
    for name in active:
        a_t = _transposed(self.lora_A[name].weight, dtype)
        b_t = _transposed(self.lora_B[name].weight, dtype)
        out = torch.addmm(out, flat @ a_t, b_t, alpha=self.scaling[name])
    return out.view(result.shape)


def install(model) -> int:
    """Give every PEFT LoRA linear of ``model`` the fused forward; returns how many layers got it."""
    from peft.tuners.lora import LoraLayer

    n = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and type(module).__name__ in LINEAR_CLASSES:
            module.forward = types.MethodType(_fast_forward, module)
            n += 1
    return n


def uninstall(model) -> None:
    """Back to PEFT's own forward (the plain path)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and "forward" in module.__dict__:
            del module.forward
