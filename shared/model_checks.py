"""Checks of a model, adapter or checkpoint directory that every service and command shares (read from their
config files and safetensors headers: no weights are loaded)."""
from __future__ import annotations

import functools
from pathlib import Path

from nla_grpo.shared.errors import NlaInputError


def load_tokenizer(model_dir: str | Path):
    """AutoTokenizer from a local directory, with a one-line error when it is not one."""
    p = Path(model_dir)
    if not (p / "tokenizer_config.json").is_file() and not (p / "tokenizer.json").is_file():
        raise NlaInputError(p, "no tokenizer here (expected tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def model_config_field(model_dir: str | Path, key: str):
    """A field of the model's config.json (top level or its text_config); None when absent."""
    from nla_grpo.shared.model_facts import field

    return field(model_dir, key)


def check_generative(model_dir: str | Path) -> None:
    """vLLM picks the model class from config.json's ``architectures``; a config written from code
    (``PretrainedConfig.to_dict()`` of a config never attached to a model) has none, and vLLM then serves
    the checkpoint as a pooling model whose ``generate`` fails only after the engines are up (3 minutes
    for a 32B shape). transformers' AutoModelForCausalLM goes by ``model_type`` and needs no such field."""
    cfg = Path(model_dir) / "config.json"
    found = model_config_field(model_dir, "architectures")
    if cfg.is_file() and not found:
        raise NlaInputError(cfg, "architectures: expected the model's generating class (such as Qwen3ForCausalLM), "
                                 f"found {found!r}: vLLM would serve the model as a pooling model that cannot generate")


def model_hidden_size(model_dir: str | Path) -> int | None:
    return model_config_field(model_dir, "hidden_size")


@functools.lru_cache(maxsize=4)
def _linear_modules(model_dir: str) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every linear layer of the model, from a model
    built on the meta device (no weights are read); built once per model for all the checks below."""
    import torch
    from transformers import AutoModelForCausalLM

    from nla_grpo.shared.model_facts import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(model_dir))
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_model_against_spec(spec, model_dir):
    """The model's tokenizer, once the model and the dataset's sidecar agree: the activations' width is the
    model's hidden size, and the marker and its neighbours are what the sidecar says in this tokenizer.
    ``data check`` and a job's checks both go through it."""
    from nla_grpo.shared.spec import validate_against_tokenizer

    hidden = model_hidden_size(model_dir)
    if hidden is not None and hidden != spec.d_model:
        raise NlaInputError(spec.path, f"extraction.d_model: expected {hidden} (hidden_size of {model_dir}), found {spec.d_model}")
    tok = load_tokenizer(model_dir)
    validate_against_tokenizer(spec, tok)
    return tok


def check_target_modules(model_dir, target_modules: list[str], field: str = "learner.target_modules") -> None:
    """Every LoRA target names a linear module of the model (checked on the meta device: no weights are
    read), so a typo stops before any actor starts instead of inside one."""
    linear = {name.rsplit(".", 1)[-1] for name in _linear_modules(str(model_dir))}
    missing = [t for t in target_modules if t not in linear]
    if missing:
        raise NlaInputError("config", f"{field}: {missing} not among the linear modules of {model_dir} "
                                      f"({', '.join(sorted(linear - {'lm_head'}))})")


def check_adapter_dir(adapter_dir, model_dir, field: str):
    """A PEFT adapter directory the learner will load (``learner.adapter_init`` / ``reference_adapter``),
    checked before any actor starts: its config and tensor file (safetensors: a pickled ``.bin`` is
    refused), targets that are linear modules of the model and not the embeddings or the head, and
    every LoRA tensor's shape against its module's (read from the header and a meta-device model).
    Returns it as ``shared.adapter.AdapterDir``."""
    import re

    from safetensors import safe_open

    from nla_grpo.shared.adapter import AdapterDir

    adapter = AdapterDir.read(adapter_dir, field)
    adapter.check_files(field)
    d, raw, weights, targets = adapter.path, adapter.config, adapter.weights, adapter.targets
    check_target_modules(model_dir, targets, f"{field} {d}: target_modules")
    linear = _linear_modules(str(model_dir))
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # a damaged header: the file's own one-line reason
        raise NlaInputError(weights, f"not a readable safetensors file ({(str(exc).splitlines() or [''])[0][:100]})") from None
    for key, shape in shapes.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        module = linear.get(m.group(1)) if m else None
        if m is None or module is None:
            raise NlaInputError(weights, f"{key}: not a LoRA tensor of a linear module of {model_dir}")
        # the module's rank: its rank_pattern entry, else r
        pattern = raw.get("rank_pattern") or {}
        r = next((int(v) for k, v in pattern.items() if re.search(rf"(^|\.){re.escape(k)}$", m.group(1))), int(raw.get("r", shape[0])))
        want = (r, module[0]) if m.group(2) == "A" else (module[1], r)
        if shape != want:
            raise NlaInputError(weights, f"{key}: expected shape {want} for {m.group(1)} of {model_dir}, found {shape}")
    return adapter


_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def check_quantization_source(model_dir, dtype: str) -> None:
    """``model.quantization: nf4`` with vLLM: vLLM quantises the weights as the checkpoint stores them,
    the learner and the critic quantise them after the cast to ``model.dtype``. When the two differ
    (an F32 checkpoint, bf16 compute) a few percent of the weights fall in the neighbouring NF4 bin and
    the rollout samples another base (on the tiny model, k3 about fifty times the bf16 pair's; from a bf16
    checkpoint the NF4 pair sits at the bf16 floor). Read from the safetensors
    headers only; a checkpoint already saved quantised must be one vLLM and the learner read alike
    (``shared.quantization.prequantized``)."""
    from safetensors import safe_open

    from nla_grpo.shared.quantization import prequantized

    d = Path(model_dir)
    if prequantized(d, vllm=True) is not None:
        return
    want = _SAFETENSORS_DTYPE[dtype]
    for path in sorted(d.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith("proj.weight"):
                    found = f.get_slice(key).get_dtype()
                    if found != want:
                        raise NlaInputError(d, f"model.quantization nf4: the checkpoint stores its linear weights as {found} "
                                               f"({key}) and model.dtype is {dtype}; vLLM would quantise the stored values "
                                               f"and the learner the {dtype} ones, two different bases: save the model in "
                                               f"{dtype} first (model.to(torch.{dtype}).save_pretrained(DIR))")
