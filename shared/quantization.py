"""The one place that decides how a base model is quantised, for every service alike.

``model.quantization: nf4`` is the reference trainer's ``--quant 4bit``: NF4 with double quantisation,
compute and storage in the model dtype (bfloat16), through bitsandbytes, GPU only. The learner's base,
the HF rollout backend and the critic's backbone load the bf16 checkpoint with ``hf_quantization``;
vLLM quantises the same checkpoint in flight with ``vllm_options`` (measured on an H200: vLLM's
in-flight NF4 against the learner's NF4 double-quant base is at the bf16 pair's logprob noise floor,
mean |Δlogp| 0.047, k3 0.0018). Nothing here imports bitsandbytes until a quantised model is built,
so the CPU path neither needs nor loads it.
"""
from __future__ import annotations

QUANTIZATIONS = ("none", "nf4")


def require_gpu(quantization: str, device) -> None:
    import torch

    if quantization != "none" and torch.device(device).type != "cuda":
        raise ValueError(f"model.quantization {quantization}: bitsandbytes NF4 needs a CUDA device, found {device!r}")


def hf_quantization(quantization: str, dtype):
    """``from_pretrained(quantization_config=...)`` for transformers, or None for an unquantised base."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=dtype)


def vllm_options(quantization: str) -> dict:
    """``vllm.LLM`` keyword arguments: in-flight bitsandbytes NF4 of the same bf16 checkpoint."""
    return {} if quantization == "none" else {"quantization": "bitsandbytes"}
