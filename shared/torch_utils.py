"""Small torch helpers every service shares (imported only where torch is needed)."""
from __future__ import annotations

import os

import torch


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """Config dtype name -> torch dtype; 'auto' = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_adamw(params, lr: float, kind: str = "auto"):
    """8-bit AdamW from bitsandbytes where asked for / available (CUDA), torch AdamW otherwise; betas (0.9, 0.95)."""
    params = list(params)
    if kind in ("auto", "adamw8bit") and params and params[0].is_cuda:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        except ImportError:
            if kind == "adamw8bit":
                raise
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def right_pad(seqs, pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids[B, L], attention_mask[B, L])`` of token lists right-padded with ``pad_id`` (causal
    attention never sees the padding after a row's last real token)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids.to(device), mask.to(device)


def settle_cuda_memory() -> dict[str, int] | None:
    """Give the caching allocator's unused blocks back to the device, then what this process's torch holds:
    ``{"allocated": bytes, "reserved": bytes, "pid": its process id}``, or None without CUDA. A service calls it once built: loading
    (a bf16 checkpoint quantised layer by layer, a state read to the device) leaves freed blocks cached, which a
    colocated GPU's other processes cannot use and the memory plan does not count."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "pid": os.getpid()}
