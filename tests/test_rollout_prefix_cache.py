"""Prefix caching in the vLLM backend is safe for the vector: a group's samples share their prompt's KV,
a prompt with the same token ids and another vector never does (embed and karvonen injection, each also with the
marker's row sent as a multimodal item, with an adapter), and the check itself catches a cache keyed on token ids
alone."""
import pytest

from rollout_support import cache_hits, expected_hits, hits_per_request, max_abs_diff, tiny_config, twin_batch, update_for, vectors_of
from nla_grpo.shared.spec import load_spec, sidecar_path

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARITY_ATOL = 1e-4
BLOCK = 32  # the CPU attention backend's smallest block; the tiny prompts (43 tokens) fill one, the marker inside it


@pytest.fixture(scope="module", params=["embed", "karvonen", "multimodal", "karvonen-multimodal"])
def engines(request, tiny_dir):
    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    injection = {"mode": "karvonen", "karvonen_layer": 0} if request.param.startswith("karvonen") else None
    route = {"vector_input": "multimodal"} if request.param.endswith("multimodal") else {}
    cfg = tiny_config(tiny_dir, injection, group_size=4, max_new_tokens=12, engine_options={"block_size": BLOCK}, **route)
    assert cfg.rollout.prefix_caching  # the default
    vllm_engine, hf = VllmEngine(cfg, spec), HfEngine(cfg, spec)
    update = update_for(cfg, 1, seed=3)
    vllm_engine.load_adapter(update)
    hf.load_adapter(update)
    yield vllm_engine, hf
    vllm_engine.close()
    hf.close()


def test_the_group_shares_its_prompt_and_another_vector_never_does(engines, tiny_dir):
    engine, hf = engines
    assert engine.prefix_caching
    G = engine.cfg.rollout.group_size
    batch = twin_batch(tiny_dir, engine, BLOCK)
    hits = cache_hits(engine)
    samples = engine.generate(batch, seed=5)
    # every sample's logprobs are those of its own vector (a twin handed request 0's KV would not be)
    assert max_abs_diff(samples, hf.recompute_logprobs(samples, vectors_of(samples, batch))) <= PARITY_ATOL
    assert hits_per_request(hits) == expected_hits(batch[0], G, BLOCK), hits
    # and the twin's group computed exactly what it computes alone
    alone = engine.generate([batch[1]], seed=5)
    assert [s.response_ids for s in alone] == [s.response_ids for s in samples[G:2 * G]]
    assert max_abs_diff(alone, [s.logprobs for s in samples[G:2 * G]]) <= 1e-5


def test_a_cache_keyed_on_token_ids_alone_is_caught(engines, tiny_dir, monkeypatch):
    """The control: with vLLM's prompt-embeds hash keys (for a multimodal item, its hash keys) switched off, the
    twin gets request 0's KV and the check above fails; so its passing means the keys keep vectors apart."""
    from vllm.v1.core import kv_cache_utils

    engine, hf = engines
    batch = twin_batch(tiny_dir, engine, BLOCK)
    if engine.vector_input == "multimodal":
        monkeypatch.setattr(kv_cache_utils, "_gen_mm_extra_hash_keys", lambda request, start, end, mm_idx: ([], mm_idx))
    else:
        monkeypatch.setattr(kv_cache_utils, "_gen_prompt_embeds_extra_hash_keys", lambda *a, **k: [])
    samples = engine.generate(batch, seed=5)
    G = engine.cfg.rollout.group_size
    twin = samples[G:2 * G]
    assert max_abs_diff(twin, hf.recompute_logprobs(twin, vectors_of(twin, [batch[1]]))) > 1e-3


def test_the_lean_logprobs_path_changes_no_token_and_no_logprob(engines, tiny_dir, monkeypatch):
    """The engine's lean sampled-logprobs path (``patches.lean_sampled_logprobs``) is in place, and vLLM's own
    gives the same tokens and the same logprobs, bit for bit, in a real engine."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    engine, _ = engines
    lean = LogprobsProcessor._update_sample_logprobs
    assert getattr(lean, "lean", False)  # the engine applied it
    batch = twin_batch(tiny_dir, engine, BLOCK)
    ours = engine.generate(batch, seed=11, ignore_eos=True)
    monkeypatch.setattr(LogprobsProcessor, "_update_sample_logprobs", lean.__wrapped__)
    theirs = engine.generate(batch, seed=11, ignore_eos=True)
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert [s.logprobs for s in ours] == [s.logprobs for s in theirs] and any(s.logprobs for s in ours)


def test_a_groups_samples_hash_their_shared_prompt_once(engines, tiny_dir, monkeypatch):
    """vLLM fans a request out into its samples, one prompt-embeddings tensor among them, and hashes every
    full block of it per sample; the engine's patch (``patches.shared_prompt_embeds_hashes``) hashes each
    block once per tensor. Counted at vLLM's SHA-256, against vLLM's own function in the same engine."""
    import hashlib
    import types

    from vllm.v1.core import kv_cache_utils

    engine, _ = engines
    if engine.vector_input == "multimodal":
        pytest.skip("token-id prompts carry no prompt embeddings to hash")
    patched = kv_cache_utils._gen_prompt_embeds_extra_hash_keys
    assert getattr(patched, "shared_per_tensor", False)  # the engine applied it
    G, new = engine.cfg.rollout.group_size, engine.cfg.rollout.max_new_tokens
    batch = twin_batch(tiny_dir, engine, BLOCK)
    blocks = sum((len(r.prompt_ids) + new) // BLOCK for r in batch)  # every sample runs to the cap (ignore_eos)
    counted = []
    monkeypatch.setattr(kv_cache_utils, "hashlib", types.SimpleNamespace(sha256=lambda b: counted.append(1) or hashlib.sha256(b)))
    shared = engine.generate(batch, seed=5, ignore_eos=True)
    assert len(counted) == blocks
    counted.clear()
    monkeypatch.setattr(kv_cache_utils, "_gen_prompt_embeds_extra_hash_keys", patched.__wrapped__)
    each = engine.generate(batch, seed=5, ignore_eos=True)
    assert len(counted) == G * blocks
    assert [s.response_ids for s in each] == [s.response_ids for s in shared]
