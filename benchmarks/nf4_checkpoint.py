"""A random checkpoint written already in bitsandbytes' serialised NF4, tensor by tensor.

A Qwen3-32B-shape checkpoint is 65 GB in bf16, more than the one-GPU machine's disk; in NF4 it is
about 18 GB. Each decoder linear weight is drawn (normal, std ``initializer_range``), quantised with
``bitsandbytes.functional.quantize_4bit`` as transformers' ``Linear4bit`` does (NF4, blocksize 64,
double quantisation, packed in uint8: the one storage vLLM reads pre-quantised) and written with its
quant state under the names transformers' 4-bit serialisation uses (``weight`` + ``weight.absmax``,
``weight.quant_map``, ``weight.nested_*``, ``weight.quant_state.bitsandbytes__nf4``); norms, embeddings and the LM head stay bf16. config.json
carries the ``quantization_config`` that tells transformers and vLLM the checkpoint is pre-quantised.

``quantized_state(named_weights)`` is the quantising step alone: given a bf16 model's weights it gives
what ``save_pretrained`` of that model loaded in NF4 writes (the same bytes, compared where bitsandbytes
runs; ``tests/test_gpu.py``). The packed storage dtype only changes how those bytes are viewed: the
learner's own NF4 (``shared.quantization``) keeps them as bf16, and dequantises them identically.
"""
from __future__ import annotations

import json
from pathlib import Path

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                       "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                       "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                       "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False,
                       "llm_int8_enable_fp32_cpu_offload": False}


def is_quantized(name: str) -> bool:
    """Decoder-block linear weights are NF4; the embeddings, norms and the head are not."""
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) >= 2 and parts[-2] in LINEAR and ".layers." in name


def quantized_state(named_weights, device: str = "cuda") -> dict:
    """``{name: tensor}`` in the 4-bit serialised layout, for ``(name, bf16 tensor)`` pairs."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    out = {}
    for name, w in named_weights:
        if not is_quantized(name):
            out[name] = w.to(torch.bfloat16).cpu().contiguous()
            continue
        packed, state = quantize_4bit(w.to(device=device, dtype=torch.bfloat16).contiguous(), blocksize=64,
                                      compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
        out[name] = packed.cpu()
        for key, value in state.as_dict(packed=True).items():
            out[f"{name}.{key}"] = value.cpu()
    return out


def write_random_nf4(out_dir, config, tokenizer_dir=None, seed: int = 0, device: str = "cuda",
                     shard_bytes: int = 4 << 30, log=print) -> Path:
    """Write a random model of ``config`` (a transformers config) pre-quantised into ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
    if getattr(config, "tie_word_embeddings", False):
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    shard, size, index, k = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, k
        if shard:
            k += 1
            fname = f"model-{k:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update({name: fname for name in shard})
            log(f"[nf4] {fname}: {len(shard)} tensors, {size / 2**30:.2f} GiB")
            shard, size = {}, 0

    for name, shape in names:
        if name.endswith("norm.weight"):
            w = torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            w = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(torch.bfloat16)
        for key, value in quantized_state([(name, w)], device).items():
            shard[key] = value
            size += value.numel() * value.element_size()
        del w
        if size >= shard_bytes:
            flush()
    flush()
    # the index names every file so that loaders find the shards; total size is the bytes on disk
    total = sum((out / f).stat().st_size for f in set(index.values()))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    raw = config.to_dict()
    raw["quantization_config"] = QUANTIZATION_CONFIG
    # a config built in code names no architecture; vLLM then serves it as a pooling model
    raw["architectures"] = raw.get("architectures") or [type(skeleton).__name__]
    raw["torch_dtype"] = raw["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
