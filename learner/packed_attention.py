"""Attention over packed shared-prefix rows without a dense mask (``learner.attention: flex``).

A packed row is ``[prompt | response_1 | ... | response_k | pad]`` (``learner.packing``): a response
attends to the prompt and causally to itself, never to another response. Given as a dense
``[R, 1, L, L]`` mask, SDPA's kernels compute every score of the L × L square and mask most away
(64 × 8 on the 8B shape: rows of ~1,400 tokens of which each response sees ~330), and the mask itself
is built on the host and copied per micro-batch. FlexAttention takes the same rule as a function of the
row's segment ids and skips the blocks it rules out: a ``BlockMask`` built on the device, then one
compiled kernel (forward and backward) for every layer, policy and reference alike.

The rule is ``learner.packing.segment_mask``'s, so the two paths compute the same attention (tests
compare them). Installed as an attention function of HF's ``AttentionInterface`` under ``NAME``; the
packed forward hands it the block mask through the decoder's ``attention_mask``.
"""
from __future__ import annotations

import torch

NAME = "nla_packed_flex"
_COMPILED = None


def _flex():
    """``flex_attention`` compiled once per process, shapes dynamic (rows and lengths vary per micro-batch)."""
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED = torch.compile(flex_attention, dynamic=True)
    return _COMPILED


def block_mask(segments: torch.Tensor):
    """The ``BlockMask`` of rows with per-position segment ids (-1 prompt, k >= 0 response k, -2 pad):
    ``segment_mask``'s rule, a pad position attending only to itself."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, L = segments.shape

    def rule(b, h, q, kv):
        sq, sk = segments[b, q], segments[b, kv]
        real = (kv <= q) & (sk != -2) & ((sk == -1) | (sk == sq)) & (sq != -2)
        return real | ((sq == -2) & (q == kv))

    return create_block_mask(rule, B=R, H=None, Q_LEN=L, KV_LEN=L, device=segments.device)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """HF attention-function signature: ``query [B, H, L, D]``, keys and values ``[B, H_kv, L, D]``;
    returns ``([B, L, H, D], None)``. ``attention_mask`` must be ``block_mask``'s."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        raise RuntimeError("learner.attention flex: the packed forward must pass packed_attention.block_mask")
    out = _flex()(query, key, value, block_mask=attention_mask, scale=scaling,
                  enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` an attention implementation HF models can select; returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    return NAME


def resolve(kind: str, device: torch.device, packed: bool, dtype: torch.dtype) -> str:
    """``learner.attention`` on ``device`` for activations of ``dtype``: ``auto`` = varlen for the packed forward on
    a GPU in 16 bits (flash-attention's kernel: as fast as flex on the GPU, and nothing to compile,
    so the first update takes half the time), flex there in float32 or on a torch without the kernel, sdpa on the CPU."""
    if kind == "auto":
        if not (packed and device.type == "cuda"):
            return "sdpa"
        from nla_grpo.learner import varlen_attention

        return "varlen" if dtype in (torch.bfloat16, torch.float16) and varlen_attention.available() else "flex"
    if kind in ("flex", "varlen") and not packed:
        raise ValueError(f"learner.attention={kind}: it reads the packed rows' segments; set learner.forward: packed")
    return kind
