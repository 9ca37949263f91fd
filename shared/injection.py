"""Activation injection, one function per mode, used by rollout and learner alike so they cannot drift.

- ``embed`` (default; the NLA release's way): the marker's input embedding is replaced by ``v``
  rescaled to the injection scale. ``embed_prompt`` builds vLLM ``prompt_embeds``;
  ``embed_batch`` builds the HF learner's ``inputs_embeds``; both call ``_place``.
- ``karvonen`` (the reference trainer's way): after decoder block ``layer``,
  ``h[site] += ||h[site]|| · v/||v||``. ``karvonen_delta`` is the maths; ``KarvonenHook`` applies it to
  an HF model. In vLLM a decoder layer returns ``(hidden, residual)`` and the stream is their sum:
  the norm must be taken of the sum (``karvonen_delta(hidden + residual, v)``), or the push is far
  too weak. Single-token decode steps never inject: the KV cache already carries the prompt.
"""
from __future__ import annotations

import torch

from nla_grpo.shared.schema import normalize_activation


def injection_vector(v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The vector written at the marker in embed mode (fp32)."""
    return normalize_activation(v.float(), scale)


def embed_norm(embed_weight: torch.Tensor) -> float:
    """Mean L2 norm of the embedding rows (the 'embed_norm' injection scale)."""
    return float(torch.linalg.vector_norm(embed_weight.detach().float(), dim=-1).mean())


def _place(embeds: torch.Tensor, sites: torch.Tensor, vectors: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Out-of-place: rows ``(b, sites[b])`` of ``embeds[B, T, d]`` replaced; ``sites[b] < 0`` leaves row b alone."""
    keep = sites >= 0
    if not bool(keep.any()):
        return embeds
    b = torch.nonzero(keep, as_tuple=True)[0]
    out = embeds.clone()
    out[b, sites[b]] = injection_vector(vectors[b], scale).to(embeds.dtype)
    return out


def embed_prompt(token_ids, embed_weight: torch.Tensor, site: int | None, vector: torch.Tensor | None, scale: float | None,
                 multiplier: float | None = None) -> torch.Tensor:
    """``prompt_embeds[T, d]`` for one prompt; ``site=None`` gives the plain token embeddings.

    ``multiplier``: what the model's embedding module applies to its rows (Gemma's sqrt(d)), applied as
    it does (the factor cast to the weight's dtype first), so the rows equal the learner's."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=embed_weight.device)
    embeds = embed_weight.detach()[ids].unsqueeze(0)
    if multiplier is not None:
        embeds = embeds * torch.tensor(multiplier).to(embed_weight.dtype)
    if site is None:
        return embeds[0]
    sites = torch.tensor([site], device=embed_weight.device)
    return _place(embeds, sites, vector.reshape(1, -1).to(embed_weight.device), scale)[0]


def embed_batch(input_ids: torch.Tensor, embedding: torch.nn.Module, sites: torch.Tensor, vectors: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``inputs_embeds[B, T, d]`` through the model's own embedding module (keeps autograd hooks)."""
    embeds = embedding(input_ids)
    return _place(embeds, sites.to(input_ids.device), vectors.to(input_ids.device), scale)


def karvonen_delta(stream: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``||stream|| · v/||v||`` per row, computed in fp32 and returned in ``stream``'s dtype."""
    s = stream.float()
    v = vectors.float()
    d = s.norm(dim=-1, keepdim=True) * v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return d.to(stream.dtype)


def karvonen_apply(hidden: torch.Tensor, sites: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Out-of-place karvonen injection on ``hidden[B, T, d]`` at ``(b, sites[b])`` (``sites[b] < 0``: none)."""
    keep = sites >= 0
    if hidden.shape[1] < 2 or not bool(keep.any()):
        return hidden
    b = torch.nonzero(keep, as_tuple=True)[0]
    s = sites[b].to(hidden.device)
    delta = torch.zeros_like(hidden)
    delta[b, s] = karvonen_delta(hidden[b, s], vectors[b].to(hidden.device))
    return hidden + delta


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder block list of an HF causal LM, through PEFT wrappers."""
    node = model
    for _ in range(6):
        if hasattr(node, "layers") and isinstance(node.layers, torch.nn.ModuleList):
            return node.layers
        node = getattr(node, "base_model", None) if not hasattr(node, "model") else node.model
        if node is None:
            break
    raise ValueError("no decoder layers found on the model")


class KarvonenHook:
    """A forward hook on block ``layer`` of an HF model; ``set(sites, vectors)`` arms it, ``clear()`` disarms.

    Keep it armed through backward when gradient checkpointing recomputes the block.
    """

    def __init__(self, model, layer: int):
        self.sites: torch.Tensor | None = None
        self.vectors: torch.Tensor | None = None
        self._handle = decoder_layers(model)[layer].register_forward_hook(self._hook)

    def set(self, sites: torch.Tensor, vectors: torch.Tensor) -> None:
        self.sites, self.vectors = sites, vectors

    def clear(self) -> None:
        self.sites = self.vectors = None

    def remove(self) -> None:
        self._handle.remove()

    def _hook(self, module, args, output):
        if self.sites is None:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] < 2:  # a decode step: the prompt (and its injection) is in the KV cache
            return output
        if hidden.shape[0] != self.sites.shape[0]:
            raise RuntimeError(f"karvonen hook armed for {self.sites.shape[0]} rows, forward has {hidden.shape[0]}")
        new = karvonen_apply(hidden, self.sites, self.vectors)
        return (new, *output[1:]) if isinstance(output, tuple) else new


# ---- the injection an adapter was trained with -------------------------------------------------
INJECTION_RECORD = "nla_injection.json"


def injection_record(cfg) -> dict:
    """What an adapter's behaviour depends on: the mode, and its layer (karvonen) or scale (embed)."""
    inj = cfg.injection
    return {"mode": inj.mode, "layer": inj.karvonen_layer if inj.mode == "karvonen" else None,
            "scale": inj.scale if inj.mode == "embed" else None}


def check_adapter_injection(adapter_dir, cfg, log=print) -> None:
    """A PEFT directory whose recorded injection differs from the run's is refused in one line; one
    without the record (the reference trainer's) is taken with a warning naming the assumed injection."""
    import json
    from pathlib import Path

    from nla_grpo.shared.errors import NlaInputError

    path = Path(adapter_dir) / INJECTION_RECORD
    want = injection_record(cfg)
    if not path.is_file():
        log(f"[warning] {adapter_dir}: no {INJECTION_RECORD}; assuming it was trained with this run's injection "
            f"(mode {want['mode']}" + (f", layer {want['layer']})" if want["mode"] == "karvonen" else f", scale {want['scale']})"))
        return
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise NlaInputError(path, "not valid JSON") from None
    if not isinstance(got, dict):
        raise NlaInputError(path, "expected a JSON object")
    for key in ("mode", "layer", "scale"):
        if got.get(key) != want[key]:
            field = {"mode": "injection.mode", "layer": "injection.karvonen_layer", "scale": "injection.scale"}[key]
            raise NlaInputError(path, f"{key}: the adapter was trained with {got.get(key)!r}, this run has {field} "
                                      f"{want[key]!r}")


# ---- what an AV-SFT adapter was trained as -------------------------------------------------------
SFT_RECORD = "nla_sft.json"


def check_adapter_sft(adapter_dir, cfg, spec, field: str) -> None:
    """An adapter ``nla-grpo sft av`` wrote records its LoRA shape and the activations it read; an RL run
    whose learner or data differ from them is refused in one line naming the field (others, e.g. the
    reference trainer's adapters, carry no record and bring their own shape)."""
    import json
    from pathlib import Path

    from nla_grpo.shared.errors import NlaInputError

    path = Path(adapter_dir) / SFT_RECORD
    if not path.is_file():
        return
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise NlaInputError(path, "not valid JSON") from None
    for key in ("lora_r", "lora_alpha", "use_rslora"):
        if key in got and got[key] != getattr(cfg.learner, key):
            raise NlaInputError(path, f"{key}: the adapter ({field}) was trained with {got[key]!r}, this run has "
                                      f"learner.{key} {getattr(cfg.learner, key)!r} (set it to match)")
    for key in ("layer_index", "d_model"):
        if key in got and got[key] != getattr(spec, key):
            raise NlaInputError(path, f"{key}: the adapter ({field}) was trained on activations with {key} {got[key]!r}, "
                                      f"this run's data ({spec.path}) have {getattr(spec, key)!r}")
