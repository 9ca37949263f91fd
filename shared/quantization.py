"""The one place that decides how a base model is quantised, for every service alike.

``model.quantization: nf4`` is the reference trainer's ``--quant 4bit``: NF4 with double quantisation,
compute and storage in the model dtype (bfloat16), through bitsandbytes, GPU only. The learner's base,
the HF rollout backend and the critic's backbone load the bf16 checkpoint with ``hf_quantization``.
vLLM quantises the same checkpoint in flight with ``vllm_options``: against the learner's NF4 double-quant
base it sits at the bf16 pair's logprob noise floor. With ``rollout.lora: merged`` it instead loads the checkpoint unquantised and sets every
decoder linear to ``nf4_roundtrip`` of its weight: the very bf16 values bitsandbytes multiplies by in the
learner, into which each push folds the adapter, so decode runs vLLM's bf16 kernels (the engine then
holds its weights in bf16). Nothing here imports bitsandbytes until a quantised model is built, so the
CPU path neither needs nor loads it.

A checkpoint saved already quantised (``quantization_config`` in its config.json) is loaded as saved by
every service; ``prequantized`` reads that section and refuses, in one line, one that is not this NF4
(another quant type, no double quantisation) or that vLLM cannot read (vLLM 0.26 accepts only uint8
packed storage for pre-quantised bitsandbytes checkpoints; transformers reads either).
"""
from __future__ import annotations

from pathlib import Path

QUANTIZATIONS = ("none", "nf4")
# what a pre-quantised checkpoint must say to be the NF4 every service here uses (values as config.json writes them)
PREQUANTIZED_NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_use_double_quant": True}
VLLM_QUANT_STORAGE = ("uint8",)


def require_gpu(quantization: str, device) -> None:
    import torch

    if quantization != "none" and torch.device(device).type != "cuda":
        raise ValueError(f"model.quantization {quantization}: bitsandbytes NF4 needs a CUDA device, found {device!r}")


def prequantized(model_dir, vllm: bool = False) -> dict | None:
    """The ``quantization_config`` of a checkpoint saved already quantised, or None; one that is not
    NF4 with double quantisation (or, with ``vllm``, not in a packed storage vLLM reads) is refused."""
    from nla_grpo.shared.errors import NlaInputError

    from nla_grpo.shared.model_facts import saved_quantization

    path = Path(model_dir) / "config.json"
    qc = saved_quantization(model_dir)  # an unreadable config.json is checked where the model is first read
    if not qc:
        return None
    for key, want in PREQUANTIZED_NF4.items():
        if qc.get(key) != want:
            raise NlaInputError(path, f"quantization_config.{key}: expected {want!r} (a checkpoint saved quantised must "
                                      f"be the NF4 with double quantisation that model.quantization nf4 means), found {qc.get(key)!r}")
    storage = qc.get("bnb_4bit_quant_storage", "uint8")
    if vllm and storage not in VLLM_QUANT_STORAGE:
        raise NlaInputError(path, f"quantization_config.bnb_4bit_quant_storage: expected one of {list(VLLM_QUANT_STORAGE)} "
                                  f"(vLLM reads no other packed storage), found {storage!r}")
    return qc


def hf_quantization_kwargs(quantization: str, dtype, model_dir) -> dict:
    """The ``from_pretrained`` keyword for the base at ``model_dir``: none for an unquantised base and for a
    checkpoint saved already quantised. The key must then be absent, not None: transformers reads an
    explicit ``quantization_config=None`` as "load unquantised", and the packed weights no longer fit."""
    if quantization == "none" or prequantized(model_dir) is not None:
        return {}
    return {"quantization_config": hf_quantization(quantization, dtype)}


def hf_quantization(quantization: str, dtype):
    """``from_pretrained(quantization_config=...)`` for transformers to quantise a bf16 checkpoint, or None."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=dtype)


def nf4_roundtrip(weight):
    """``weight`` as the learner's NF4 base computes with it: quantised as ``hf_quantization`` quantises a
    linear's weight (bitsandbytes' ``Params4bit``: NF4, blocks of 64, double quantisation, storage in the
    weight's dtype), then dequantised, which is what bitsandbytes multiplies by. CUDA tensors only."""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4",
                                       quant_storage=weight.dtype)
    return bnbf.dequantize_4bit(packed, state).to(weight.dtype)


def roundtrip_by_parts(weight, sizes, roundtrip):
    """``roundtrip`` applied to each row block of a fused weight (``sizes`` rows each, in order) on its own.

    vLLM fuses q/k/v and gate/up into one weight; the learner quantises each as its own module, and double
    quantisation (the absmax values quantised around their mean) makes a block's result depend on the whole
    tensor it belongs to, so the fused weight must be quantised part by part to equal the learner's."""
    import torch

    if sum(sizes) != weight.shape[0]:
        raise ValueError(f"parts of {list(sizes)} rows do not make a weight of {weight.shape[0]} rows")
    return torch.cat([roundtrip(part) for part in torch.split(weight, list(sizes), dim=0)], dim=0)


def vllm_options(quantization: str) -> dict:
    """``vllm.LLM`` keyword arguments: in-flight bitsandbytes NF4 of the same bf16 checkpoint."""
    return {} if quantization == "none" else {"quantization": "bitsandbytes"}
