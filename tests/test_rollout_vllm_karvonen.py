"""karvonen injection in the vLLM backend: parity with the HF engine's hook, per-request vectors in a
batch, no injection on request, and after an adapter push."""
import pytest
import torch

from rollout_support import max_abs_diff, tiny_config, tiny_requests, update_for, vectors_of
from shared.spec import load_spec, sidecar_path

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from rollout.hf_engine import HfEngine
    from rollout.vllm_engine import VllmEngine

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
