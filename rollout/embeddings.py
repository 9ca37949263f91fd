"""Read only the input-embedding matrix from a model's safetensors (the vLLM actor never loads the HF model).

Handles single-file and sharded checkpoints (through ``model.safetensors.index.json``) and tied
embeddings (a checkpoint that stores only ``lm_head.weight``).
"""
from __future__ import annotations

import json
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _tensor_files(model_path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        return {name: model_path / fname for name, fname in weight_map.items()}
    single = model_path / SINGLE_FILE
    if not single.is_file():
        raise NlaInputError(model_path, f"expected {SINGLE_FILE} or {INDEX_FILE}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _tied(model_path: Path) -> bool:
    from nla_grpo.shared.model_facts import tied_embeddings

    return tied_embeddings(model_path)


def embedding_tensor_name(names) -> str | None:
    """The input-embedding weight among checkpoint tensor names (shortest match: the language model's)."""
    hits = sorted((n for n in names if n.endswith("embed_tokens.weight")), key=len)
    return hits[0] if hits else None


def load_embed_tokens(model_path, dtype=None, device: str = "cpu"):
    """The ``[vocab, d]`` input-embedding weight, in ``dtype`` (default: as stored)."""
    from safetensors import safe_open

    path = Path(model_path)
    files = _tensor_files(path)
    name = embedding_tensor_name(files)
    if name is None and _tied(path):
        name = next((n for n in sorted(files, key=len) if n.endswith("lm_head.weight")), None)
    if name is None:
        raise NlaInputError(path, "no '*embed_tokens.weight' tensor in the checkpoint (nor a tied lm_head.weight)")
    with safe_open(str(files[name]), framework="pt", device=device) as f:
        weight = f.get_tensor(name)
    return weight if dtype is None else weight.to(dtype)


# families whose HF embedding module multiplies the looked-up rows by sqrt(hidden_size) (in the weight's
# dtype); vLLM applies its normaliser to token ids only, never to prompt_embeds, so the rows built here
# from the raw matrix need it too
SCALED_EMBEDDINGS = ("gemma", "gemma2", "gemma3", "gemma3_text")


def embedding_multiplier(model_path) -> float | None:
    """The factor the model's own embedding applies to its rows (Gemma: sqrt(hidden_size)), or None."""
    from nla_grpo.shared.model_facts import stored_config

    cfg = stored_config(model_path)
    if not cfg:
        return None
    text = cfg.get("text_config") or cfg
    if cfg.get("model_type") in SCALED_EMBEDDINGS or text.get("model_type") in SCALED_EMBEDDINGS:
        return float(text.get("hidden_size", cfg.get("hidden_size"))) ** 0.5
    return None
