"""Attention over packed shared-prefix rows as variable-length segments (``learner.attention: varlen``).

A packed row ``[prompt | response_1 | ... | response_k | pad]`` (``learner.packing``) is cut into query
segments: the prompt, each response, the pad run. Each segment gets its own keys: the prompt's keys for
the prompt, the prompt's keys followed by the response's own for a response, the pad run's own for the
pads. A causal mask aligned to the bottom right (query ``i`` of a segment of ``q`` queries and ``k`` keys
sees keys ``<= i + k - q``) then gives exactly ``learner.packing.segment_mask``'s rule: the prompt causally
to itself, a response to the whole prompt and causally to itself, never to another response. (A pad
attends to the pads before it instead of to itself alone; no real token attends to a pad, so no real
output changes.)

That is the layout of flash-attention's variable-length kernel (``torch.nn.attention.varlen``): it computes
the scores the rule allows and little beside them, where FlexAttention runs every 128 x 128 block the rule
touches (a row of the 64 x 8 workload, a 181-token prompt and 8 responses of 150: 324k allowed scores per
head, 39 blocks = 639k computed). FlexAttention's backward took 11% of the 8B update
for about 1% of its FLOPs (the allowed scores against the linears').

The queries stay where they are (``[R·L, H, D]``, a view of the projections); only keys and values are
gathered, each prompt key once per segment that reads it. The gather's backward sums a prompt key's
copies in a fixed order (``_GatherRows``): it adds no run-to-run variation of its own, as an atomic scatter-add
would (the kernel's backward is flash-attention's, deterministic under ``torch.use_deterministic_algorithms``).

The kernel runs CUDA bf16/fp16. Anywhere else (the CPU, fp32) the same layout runs through SDPA one
segment at a time: the same maths, which the CPU tests certify against the dense mask.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

import torch

NAME = "nla_packed_varlen"
KWARG = "nla_varlen"  # the decoder forwards unknown keyword arguments to every attention call


@dataclass
class VarlenLayout:
    """The segments of one packed micro-batch of ``R`` rows of ``L`` positions (flat index ``r·L + p``)."""

    cu_q: torch.Tensor  # int32 [N + 1]: segment n's queries are flat positions cu_q[n] .. cu_q[n+1]-1
    cu_k: torch.Tensor  # int32 [N + 1]: its keys are rows cu_k[n] .. cu_k[n+1]-1 of the gathered keys
    max_q: int
    max_k: int
    k_index: torch.Tensor  # int64 [T_k]: the flat position each gathered key row is taken from
    first: torch.Tensor  # int64 [R·L]: the first gathered row of each flat position
    shared: torch.Tensor  # int64 [S]: flat positions gathered more than once (the prompts)
    shared_rows: torch.Tensor  # int64 [S, m]: every gathered row of each, padded with T_k (a zero row)

    def to(self, device) -> "VarlenLayout":
        def move(v):
            return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v

        return VarlenLayout(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def layout(segments: torch.Tensor) -> VarlenLayout:
    """The varlen segments of rows with per-position ids (-1 prompt, k >= 0 response k, -2 pad), on the CPU.

    A row must read prompt, then responses (each one run), then pads, as ``learner.packing.pack`` lays it.
    Index arithmetic per segment (a micro-batch has tens), none per position in Python."""
    R, L = segments.shape
    cu_q, cu_k, k_parts, own_parts, shared, shared_rows = [0], [0], [], [], [], []
    max_q = max_k = 0
    total_k = 0
    for r in range(R):
        ids, counts = torch.unique_consecutive(segments[r], return_counts=True)
        ids, counts = ids.tolist(), counts.tolist()
        body = ids[:-1] if ids[-1] == -2 else ids
        if body[0] != -1 or -1 in body[1:] or -2 in body or len(set(body[1:])) != len(body) - 1:
            raise ValueError(f"varlen layout: row {r} is not [prompt | responses | pad], found runs {ids}")
        base, P = r * L, counts[0]
        prompt = torch.arange(base, base + P)
        starts, s = [], 0  # where each segment reading the prompt starts among the gathered rows
        for sid, n in zip(ids, counts):
            own = torch.arange(base + s, base + s + n)
            keys = own if sid < 0 else torch.cat([prompt, own])  # the prompt and the pads: their own keys
            if sid != -2:
                starts.append(total_k)
            k_parts.append(keys)
            own_parts.append(torch.arange(total_k + len(keys) - n, total_k + len(keys)))
            total_k += len(keys)
            s += n
            cu_q.append(base + s)
            cu_k.append(total_k)
            max_q, max_k = max(max_q, n), max(max_k, len(keys))
        shared.append(prompt)
        shared_rows.append(torch.tensor(starts)[None, :] + torch.arange(P)[:, None])
    m = max(t.shape[1] for t in shared_rows)
    rows = torch.cat([torch.nn.functional.pad(t, (0, m - t.shape[1]), value=total_k) for t in shared_rows])
    return VarlenLayout(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max_q, max_k,
                        torch.cat(k_parts), torch.cat(own_parts), torch.cat(shared), rows)


class _GatherRows(torch.autograd.Function):
    """``x[k_index]``; backward: each position's gradient is its copies' sum, added in a fixed order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lay: VarlenLayout):
        ctx.lay = lay
        return x.index_select(0, lay.k_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lay = ctx.lay
        out = grad.index_select(0, lay.first)
        if lay.shared.numel():
            padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
            acc = torch.promote_types(grad.dtype, torch.float32)  # bf16 copies summed in fp32, rounded once
            summed = padded[lay.shared_rows].sum(1, dtype=acc).to(grad.dtype)
            out.index_copy_(0, lay.shared, summed)
        return out, None


def gather_keys(x: torch.Tensor, lay: VarlenLayout) -> torch.Tensor:
    """The segments' keys (or values) ``[T_k, H_kv, D]`` from the flat ``x[R·L, H_kv, D]``."""
    return _GatherRows.apply(x, lay)


def reference(q, k, v, lay: VarlenLayout, scale: float | None = None) -> torch.Tensor:
    """The layout's attention through SDPA, one segment at a time: ``q[T_q, H, D]``, gathered ``k, v[T_k, H_kv, D]``."""
    import torch.nn.functional as F

    cu_q, cu_k = lay.cu_q.tolist(), lay.cu_k.tolist()
    groups = q.shape[1] // k.shape[1]
    outs = []
    for n in range(len(cu_q) - 1):
        keys = slice(cu_k[n], cu_k[n + 1])
        qs, ks, vs = (t.transpose(0, 1) for t in (q[cu_q[n]:cu_q[n + 1]], k[keys], v[keys]))
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # bottom-right causal
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(outs)


_KERNEL: list = []


def _kernel():
    """``(varlen_attn, its keyword arguments for a bottom-right causal mask, whether it takes enable_gqa)``.

    torch 2.11's ``varlen_attn`` takes ``window_size=(-1, 0)`` for causal, 2.13's also wants ``enable_gqa``
    for fewer key heads; the kernel underneath (flash-attention 2) aligns a causal mask bottom right."""
    if not _KERNEL:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            raise RuntimeError(f"learner.attention=varlen needs torch.nn.attention.varlen (torch >= 2.11), "
                               f"found torch {torch.__version__}") from None
        params = inspect.signature(varlen_attn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        _KERNEL.append((varlen_attn, causal, "enable_gqa" in params))
    return _KERNEL[0]


def available() -> bool:
    """Whether the installed torch has flash-attention's variable-length kernel (``torch.nn.attention.varlen``)."""
    try:
        _kernel()
        return True
    except RuntimeError:
        return False


def uses_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def flash(q, k, v, lay: VarlenLayout, scale: float | None = None) -> torch.Tensor:
    """The layout's attention by flash-attention's varlen kernel: ``q[T_q, H, D]``, gathered ``k, v[T_k, H_kv, D]``."""
    fn, causal, takes_gqa = _kernel()
    extra = {"enable_gqa": True} if takes_gqa and q.shape[1] != k.shape[1] else {}
    return fn(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, scale=scale, **causal, **extra)


def attend(q, k, v, lay: VarlenLayout, scale: float | None = None) -> torch.Tensor:
    """Attention of flat ``q[R·L, H, D]`` over the layout's segments of flat ``k, v[R·L, H_kv, D]``."""
    k, v = gather_keys(k, lay), gather_keys(v, lay)
    if uses_kernel(q):
        return flash(q, k, v, lay, scale)
    if q.is_cuda and not _WARNED:
        import warnings

        _WARNED.append(True)
        warnings.warn(f"learner.attention varlen: {q.dtype} activations on the GPU run the per-segment SDPA fallback, "
                      "not flash-attention's kernel (bfloat16/float16 only)", RuntimeWarning)
    return reference(q, k, v, lay, scale)


_WARNED: list = []


def _attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """HF attention-function signature: ``query [B, H, L, D]``, keys and values ``[B, H_kv, L, D]``;
    returns ``([B, L, H, D], None)``. The layout comes as the ``KWARG`` keyword argument."""
    lay = kwargs.get(KWARG)
    if not isinstance(lay, VarlenLayout):
        raise RuntimeError(f"learner.attention varlen: the packed forward must pass the layout as {KWARG}=")
    B, H, L, D = query.shape
    flat = lambda t: t.transpose(1, 2).reshape(B * L, t.shape[1], D)  # noqa: E731
    out = attend(flat(query), flat(key), flat(value), lay, scaling)
    return out.view(B, L, H, D), None


def register() -> str:
    """Make ``NAME`` an attention implementation HF models can select (no mask is built for it); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    return NAME
