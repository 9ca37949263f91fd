"""``karvonen`` injection inside vLLM: ``h[site] += ||h[site]|| · v/||v||`` after decoder block L.

vLLM runs the whole batch as one flat ``[tokens, d]`` stream, so a forward hook alone cannot tell
which row is whose marker. The engine marks each site in the request's ``prompt_embeds``: the
marker row is replaced by a *sentinel* row (three magic values, then the request's index in this
``generate`` call). Inside the worker:

- a pre-hook on block 0 finds the sentinel rows, puts the marker token's own embedding back (so
  block 0 sees exactly the token-id prompt) and notes (rows, vectors) for this forward;
- a hook on block L adds the norm-matched vector at those rows. vLLM's blocks return
  ``(hidden, residual)`` and the stream is their sum, so the norm is taken of the sum
  (``shared.injection.karvonen_delta``, the maths the HF learner uses).

This holds under chunked prefill (a sentinel row sits in exactly one chunk), preemption (a
recomputed prompt is re-marked and re-injected) and decode steps (sampled tokens are never
sentinels). The hooks are Python with data-dependent indexing, so the engine runs eager in this mode
(no torch.compile, no CUDA graphs); the row lookup costs one host sync per forward, and touches only
the marked rows (a mask over every row would need fp32 temporaries of the whole batch, memory vLLM's
profiling never reserved). The magic values and indices (< 256 per coordinate) are exact in fp32,
bf16 and fp16. vLLM must run the v1 model runner with one data-parallel rank (this project's
engines): its data-parallel dummy steps reuse a stale input buffer.
"""
from __future__ import annotations

import torch

from rollout.vllm_compat import worker_model

MAGIC = (32768.0, -32768.0, 16384.0)
MAX_REQUESTS = 256 * 256


def mark_site(embeds: torch.Tensor, site: int, index: int) -> torch.Tensor:
    """``embeds[T, d]`` with row ``site`` replaced by the sentinel of request ``index`` (out of place)."""
    if not 0 <= index < MAX_REQUESTS:
        raise ValueError(f"karvonen: at most {MAX_REQUESTS} requests per generate call, found index {index}")
    out = embeds.clone()
    row = torch.zeros(embeds.shape[-1], dtype=embeds.dtype, device=embeds.device)
    row[:3] = torch.tensor(MAGIC, dtype=embeds.dtype)
    row[3], row[4] = index // 256, index % 256
    out[site] = row
    return out


def find_sites(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, request indices) of the sentinel rows in a flat ``hidden[N, d]``."""
    hit = (hidden[:, 0] == MAGIC[0]) & (hidden[:, 1] == MAGIC[1]) & (hidden[:, 2] == MAGIC[2])
    rows = torch.nonzero(hit, as_tuple=True)[0]
    index = hidden[rows, 3].round().long() * 256 + hidden[rows, 4].round().long()
    return rows, index


class KarvonenSites:
    """The worker-side state: the marker's embedding, the vectors armed for the current call, and
    the rows found by block 0 for the forward in progress."""

    def __init__(self, layers: torch.nn.ModuleList, layer: int, marker_row: torch.Tensor):
        self.marker_row = marker_row
        self.vectors: torch.Tensor | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = [layers[0].register_forward_pre_hook(self._restore),
                         layers[layer].register_forward_hook(self._inject)]

    def arm(self, vectors: torch.Tensor | None) -> None:
        self.vectors, self.pending = vectors, None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _restore(self, module, args):
        if len(args) < 2:  # vLLM's Qwen2/3 models call layer(positions, hidden, residual) positionally
            raise RuntimeError("karvonen: vLLM called decoder block 0 without positional hidden states")
        positions, hidden, *rest = args
        rows, index = find_sites(hidden)
        self.pending = None
        if rows.numel() == 0:
            return None
        if self.vectors is None or int(index.max()) >= self.vectors.shape[0]:
            armed = 0 if self.vectors is None else self.vectors.shape[0]
            raise RuntimeError(f"karvonen: a marked site for request {int(index.max())}, but {armed} vectors are armed")
        hidden = hidden.clone()
        hidden[rows] = self.marker_row.to(hidden.dtype)
        self.pending = (rows, self.vectors[index])
        return (positions, hidden, *rest)

    def _inject(self, module, args, output):
        if self.pending is None:
            return None
        from shared.injection import karvonen_delta

        rows, vectors = self.pending
        self.pending = None
        hidden, residual = output
        delta = karvonen_delta(hidden[rows] + residual[rows], vectors)
        return (hidden.index_add(0, rows, delta), residual)


# -- run inside each vLLM worker through LLM.collective_rpc (plain bytes cross a process boundary) --

def install_in_worker(worker, layer: int, marker_row: bytes, dtype: str) -> int:
    """Hook blocks 0 and ``layer``; returns the number of decoder blocks."""
    from shared.injection import decoder_layers

    model = worker_model(worker)
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"injection.karvonen_layer: expected 0..{len(layers) - 1}, found {layer}")
    device = next(model.parameters()).device
    row = torch.frombuffer(bytearray(marker_row), dtype=torch.float32).to(device=device, dtype=getattr(torch, dtype))
    model._nla_karvonen = KarvonenSites(layers, layer, row)
    return len(layers)


def arm_in_worker(worker, vectors: bytes | None, n: int, d: int) -> None:
    """Vectors (fp32 bytes, ``n x d``) for the requests of the next generate call; None disarms."""
    sites = worker_model(worker)._nla_karvonen
    if vectors is None:
        sites.arm(None)
        return
    device = sites.marker_row.device
    sites.arm(torch.frombuffer(bytearray(vectors), dtype=torch.float32).reshape(n, d).to(device))
