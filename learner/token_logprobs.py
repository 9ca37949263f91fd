"""Per-token logprobs through the LM head without a ``[tokens, vocab]`` fp32 tensor for the batch.

``token_logprobs(hidden[M, d], weight[V, d], targets[M])`` = ``log_softmax(hidden @ weightᵀ)[m, targets[m]]``
in fp32, computed ``chunk`` rows at a time; backward recomputes each chunk's logits instead of keeping
them (the LM head is frozen, so only the hidden states get a gradient). The logits are rounded to the
head's dtype before the fp32 softmax, exactly as the plain ``lm_head`` + ``log_softmax(logits.float())``
path does, so both paths give the same numbers.

At Qwen3's 152k vocabulary one chunk of 2 048 rows is ~1.2 GB of fp32 logits, against ~24 GB for
the 20 000 response tokens of a large micro-batch all at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 30


def default_chunk(vocab: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        M = hidden.shape[0]
        out = torch.empty(M, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(M, dtype=torch.float32, device=hidden.device)
        for s in range(0, M, chunk):
            logits = F.linear(hidden[s: s + chunk], weight).float()
            lse[s: s + chunk] = logits.logsumexp(dim=-1)
            out[s: s + chunk] = logits.gather(1, targets[s: s + chunk, None]).squeeze(1) - lse[s: s + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            raise RuntimeError("token_logprobs: the LM head must be frozen (no weight gradient is computed)")
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden)
        g = grad_out.float()
        for s in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[s: s + chunk], weight).float()
            # d logp[t] / d logits = onehot(t) - softmax(logits)
            grad_logits = torch.exp(logits - lse[s: s + chunk, None]).mul_(-g[s: s + chunk, None])
            rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
            grad_logits[rows, targets[s: s + chunk]] += g[s: s + chunk]
            grad_hidden[s: s + chunk] = grad_logits.to(weight.dtype) @ weight
        return grad_hidden, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """fp32 ``log softmax(hidden @ weightᵀ)`` at ``targets``, one value per row of ``hidden``."""
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: expected hidden[M, d] and targets[M], found {tuple(hidden.shape)} and {tuple(targets.shape)}")
    chunk = chunk or default_chunk(weight.shape[0])
    return _TokenLogprobs.apply(hidden, weight, targets, chunk)
