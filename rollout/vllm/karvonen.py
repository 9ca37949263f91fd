"""``karvonen`` injection inside vLLM's own forward: ``h[site] += ||h[site]|| · v/||v||`` after block L.

The injection is a model class of its own (``NlaKarvonen<Arch>``: Qwen3, Qwen2, Llama), registered
out of tree by the ``vllm.general_plugins`` entry point (``rollout.vllm.plugin``) and chosen per
engine with ``hf_overrides``. Each subclasses the stock vLLM model, so weights, LoRA and tensor
parallelism work unchanged; only the inner model's ``forward`` differs, and it is what vLLM
compiles and captures in CUDA graphs.

The per-request vector travels in the request's ``prompt_embeds`` (or, with ``rollout.vector_input:
multimodal``, as the marker's embeddings-only item, which vLLM merges into the input embeddings the forward
gets: ``rollout.vllm.marker_input``): the marker row is a *sentinel*,
the vector's direction scaled to norm 2^14, far above any token embedding. Inside the forward every
op is dense, shape-static and free of host syncs (so torch.compile and CUDA graphs keep it):

- rows whose norm exceeds 2^13 are the sites; they get the marker token's own embedding back
  before block 0, so block 0 sees exactly the token-id prompt;
- after block L, ``hidden += mask · ||hidden + residual|| · sentinel/||sentinel||`` (vLLM's blocks
  return ``(hidden, residual)`` and the stream is their sum: ``shared.injection.karvonen_delta``'s
  maths, the HF learner's).

This holds under chunked prefill (a sentinel row sits in exactly one chunk), preemption (a recomputed
prompt is re-fed its ``prompt_embeds``) and decode steps (a sampled token's embedding is never a
sentinel: nothing is added). Prefix caching stays safe: vLLM hashes ``prompt_embeds`` (a multimodal
item's bytes) into each block's cache key, so two prompts with the same token ids and different vectors
never share KV.
"""
from __future__ import annotations

import contextlib

import torch

SENTINEL_NORM = 2.0 ** 14
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
PREFIX = "NlaKarvonen"


def sentinel_row(vector: torch.Tensor) -> torch.Tensor:
    """The marker row that carries ``vector`` (fp32): its direction at norm ``SENTINEL_NORM``."""
    v = vector.detach().float().reshape(-1)
    norm = torch.linalg.vector_norm(v)
    if not torch.isfinite(norm) or float(norm) == 0.0:
        raise ValueError("karvonen: the activation vector must be finite and non-zero")
    return v * (SENTINEL_NORM / norm)


def mark_site(embeds: torch.Tensor, site: int, vector: torch.Tensor) -> torch.Tensor:
    """``embeds[T, d]`` with row ``site`` replaced by the sentinel of ``vector`` (out of place)."""
    out = embeds.clone()
    out[site] = sentinel_row(vector).to(embeds.dtype)
    return out


def hf_overrides(architecture: str, layer: int, marker_id: int) -> dict:
    """``vllm.LLM(hf_overrides=...)`` that selects the injecting model class for this checkpoint."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"injection.mode karvonen on vLLM: expected a model of {', '.join(ARCHITECTURES)}, "
                         f"found {architecture}")
    return {"architectures": [PREFIX + architecture], "nla_karvonen_layer": int(layer), "nla_marker_id": int(marker_id)}


def inject(hidden: torch.Tensor, residual: torch.Tensor, embeds: torch.Tensor, sites: torch.Tensor,
           sentinel_norm: torch.Tensor) -> torch.Tensor:
    """``hidden`` after the block-L add at the ``sites`` rows (``sites[N, 1]`` bool, ``sentinel_norm``
    their ``embeds`` rows' norms): dense, so compiled graphs keep it."""
    stream = torch.linalg.vector_norm(hidden + residual, dim=-1, keepdim=True, dtype=torch.float32)
    scale = torch.where(sites, stream / sentinel_norm, torch.zeros_like(stream))
    return hidden + (embeds.float() * scale).to(hidden.dtype)


def find_sites(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sites[N, 1] bool, norms[N, 1] fp32)`` of a flat ``embeds[N, d]``."""
    norms = torch.linalg.vector_norm(embeds, dim=-1, keepdim=True, dtype=torch.float32)
    return norms > SENTINEL_NORM / 2, norms


def _forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **layer_kwargs):
    """The stock decoder loop (one pipeline stage) with the sentinel swap before block 0 and the add
    after block ``nla_layer``."""
    sites = norms = None
    if inputs_embeds is None:
        hidden = self.embed_input_ids(input_ids)
    else:
        sites, norms = find_sites(inputs_embeds)
        marker = self.embed_input_ids(self.nla_marker_ids).to(inputs_embeds.dtype)
        hidden = torch.where(sites, marker, inputs_embeds)
    residual = None
    for idx in range(self.start_layer, self.end_layer):
        hidden, residual = self.layers[idx](positions, hidden, residual, **layer_kwargs)
        if idx == self.nla_layer and sites is not None:
            hidden = inject(hidden, residual, inputs_embeds, sites, norms)
    hidden, _ = self.norm(hidden, residual)
    return hidden


def _setup(model, vllm_config) -> None:
    config = vllm_config.model_config.hf_config
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("injection.mode karvonen: vLLM pipeline parallelism is not supported")
    layer = int(getattr(config, "nla_karvonen_layer"))
    if not 0 <= layer < model.end_layer:
        raise ValueError(f"injection.karvonen_layer: expected 0..{model.end_layer - 1}, found {layer}")
    model.nla_layer = layer
    # a buffer on the model's device: indexing the embedding with it stays inside the graph
    model.register_buffer("nla_marker_ids", torch.tensor([int(config.nla_marker_id)], dtype=torch.long), persistent=False)


def _model_class(base: type) -> type:
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        _setup(self, vllm_config)

    return type(PREFIX + base.__name__, (base,), {"__init__": __init__, "forward": _forward, "__module__": __name__})


@contextlib.contextmanager
def _building_with(module, name: str, cls: type):
    """``module.name`` is ``cls`` while the stock causal-LM class builds its inner model (it names the
    stock class directly), and the stock one again afterwards."""
    stock = getattr(module, name)
    setattr(module, name, cls)
    try:
        yield
    finally:
        setattr(module, name, stock)


def _causal_lm_class(module, lm_name: str, model_name: str) -> type:
    lm = getattr(module, lm_name)
    inner = _model_class(getattr(module, model_name))

    def __init__(self, *, vllm_config, prefix: str = ""):
        with _building_with(module, model_name, inner):
            lm.__init__(self, vllm_config=vllm_config, prefix=prefix)

    return type(PREFIX + lm_name, (lm,), {"__init__": __init__, "__module__": __name__})


def _qwen3():
    from vllm.model_executor.models import qwen3

    return _causal_lm_class(qwen3, "Qwen3ForCausalLM", "Qwen3Model")


def _qwen2():
    from vllm.model_executor.models import qwen2

    return _causal_lm_class(qwen2, "Qwen2ForCausalLM", "Qwen2Model")


def _llama():
    from vllm.model_executor.models import llama

    return _causal_lm_class(llama, "LlamaForCausalLM", "LlamaModel")


def __getattr__(name: str):
    """The registry imports ``rollout.vllm.karvonen:NlaKarvonen<Arch>`` by name, in each vLLM process."""
    build = {PREFIX + "Qwen3ForCausalLM": _qwen3, PREFIX + "Qwen2ForCausalLM": _qwen2, PREFIX + "LlamaForCausalLM": _llama}
    if name not in build:
        raise AttributeError(name)
    cls = build[name]()
    globals()[name] = cls
    return cls
