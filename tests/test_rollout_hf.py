"""The HF generate() backend: reference sampling, stop handling, both injection modes, adapter swaps."""
import pytest
import torch

from rollout_support import compare_to_untrimmed, max_abs_diff, tiny_config, tiny_requests, update_for, vectors_of
from nla_grpo.shared.spec import load_spec, sidecar_path

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def spec(tiny_dir):
    return load_spec(sidecar_path(tiny_dir / "rl.parquet"))


@pytest.fixture(scope="module")
def engine(tiny_dir, spec):
    from nla_grpo.rollout.hf_engine import HfEngine

    eng = HfEngine(tiny_config(tiny_dir, group_size=8, max_new_tokens=40), spec)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def requests(tiny_dir, spec, engine):
    return tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 24, prefill=engine.cfg.rollout.prefill)


def test_groups_layout_and_fixed_seed(engine, requests):
    reqs = requests[:3]
    a = engine.generate(reqs, seed=5)
    G = engine.cfg.rollout.group_size
    assert [(s.row_id, s.group_index) for s in a] == [(r.row_id, g) for r in reqs for g in range(G)]
    assert all(s.adapter_version == 0 and s.prompt_ids == reqs[i // G].prompt_ids for i, s in enumerate(a))
    assert len({tuple(s.response_ids) for s in a}) > G  # samples of a group differ
    b = engine.generate(reqs, seed=5)
    assert [(s.response_ids, s.logprobs) for s in a] == [(s.response_ids, s.logprobs) for s in b]
    c = engine.generate(reqs, seed=6)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_stop_trimming_on_each_stop_id_and_cap(engine, requests):
    stopped = engine.generate(requests, seed=11)
    untrimmed = engine.generate(requests, seed=11, ignore_eos=True)
    cap = engine.cfg.rollout.max_new_tokens
    assert all(len(u.response_ids) == cap and u.finish_reason == "length" for u in untrimmed)
    problems, seen = compare_to_untrimmed(stopped, untrimmed, engine.stop_ids, cap)
    assert not problems, problems[:5]
    assert seen == set(engine.stop_ids), f"stop ids never ended a sample: {set(engine.stop_ids) - seen}"
    assert {s.finish_reason for s in stopped} == {"stop", "length"}


def test_sampled_logprobs_match_teacher_forcing_across_adapter_swaps(engine, requests):
    reqs = requests[:4]
    base = engine.generate(reqs, seed=1)
    assert max_abs_diff(base, engine.recompute_logprobs(base, vectors_of(base, reqs))) <= PARITY_ATOL
    plain = engine.generate(reqs, seed=1, inject=False)
    assert max_abs_diff(plain, engine.recompute_logprobs(plain, None)) <= PARITY_ATOL
    engine.load_adapter(update_for(engine.cfg, 1, seed=1))
    v1 = engine.generate(reqs, seed=1)
    assert {s.adapter_version for s in v1} == {1} and engine.adapter_version == 1
    v1_recomputed = engine.recompute_logprobs(v1, vectors_of(v1, reqs))
    assert max_abs_diff(v1, v1_recomputed) <= PARITY_ATOL
    assert max_abs_diff(base, engine.recompute_logprobs(base, vectors_of(base, reqs))) > 0.05  # the adapter acts
    engine.load_adapter(update_for(engine.cfg, 2, seed=2))
    v2 = engine.generate(reqs, seed=1)
    assert {s.adapter_version for s in v2} == {2}
    assert max_abs_diff(v2, engine.recompute_logprobs(v2, vectors_of(v2, reqs))) <= PARITY_ATOL
    assert max_abs_diff(v1, engine.recompute_logprobs(v1, vectors_of(v1, reqs))) > 0.05  # v1 is gone
    assert list(engine.model.peft_config) == ["policy-v2"]
    with pytest.raises(ValueError, match="not newer"):
        engine.load_adapter(update_for(engine.cfg, 2, seed=3))


def test_karvonen_mode_generates_with_the_hook(tiny_dir, spec):
    from nla_grpo.rollout.hf_engine import HfEngine

    # block 0: the tiny model has two blocks, and a push after the last one reaches only the marker's own logits
    eng = HfEngine(tiny_config(tiny_dir, injection={"mode": "karvonen", "karvonen_layer": 0}, max_new_tokens=12), spec)
    try:
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, eng.tokenizer, 3, prefill=eng.cfg.rollout.prefill)
        out = eng.generate(reqs, seed=3)
        vecs = vectors_of(out, reqs)
        injected = eng.recompute_logprobs(out, vecs)
        assert max_abs_diff(out, injected) <= PARITY_ATOL
        # the hook matters: without it (or with another vector) the same tokens score differently
        assert max_abs_diff(out, eng.recompute_logprobs(out, None)) > 1e-3
        assert max_abs_diff(out, eng.recompute_logprobs(out, [torch.tensor(v).flip(0) for v in vecs])) > 1e-3
        eng.load_adapter(update_for(eng.cfg, 1, seed=1))
        v1 = eng.generate(reqs, seed=3)
        assert max_abs_diff(v1, eng.recompute_logprobs(v1, vecs)) <= PARITY_ATOL
    finally:
        eng.close()


def test_embed_injection_changes_first_token_distribution(engine, requests):
    import torch.nn.functional as F

    from nla_grpo.shared.injection import embed_batch

    req = requests[0]
    ids = torch.tensor([req.prompt_ids])
    emb = engine.model.get_input_embeddings()
    dists = []
    for v in (torch.tensor(requests[0].vector), torch.tensor(requests[1].vector), None):
        site = torch.tensor([req.site if v is not None else -1])
        vec = (v if v is not None else torch.ones(engine.spec.d_model)).reshape(1, -1)
        with torch.no_grad():
            logits = engine.model(inputs_embeds=embed_batch(ids, emb, site, vec, engine.scale)).logits[0, -1]
        dists.append(F.log_softmax(logits.float(), -1))
    with torch.no_grad():
        token_prompt = F.log_softmax(engine.model(input_ids=ids).logits[0, -1].float(), -1)
    assert (dists[0] - dists[1]).abs().max() > 1e-2
    assert torch.equal(dists[2], token_prompt)
