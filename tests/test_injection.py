import pytest
import torch

from nla_grpo.shared.injection import KarvonenHook, embed_batch, embed_prompt, injection_vector, karvonen_apply, karvonen_delta


def test_embed_prompt_replaces_only_the_site():
    torch.manual_seed(0)
    W = torch.randn(50, 16)
    ids = [3, 7, 9, 11]
    v = torch.randn(16)
    out = embed_prompt(ids, W, 2, v, scale=4.0)
    assert torch.equal(out[[0, 1, 3]], W[[3, 7, 11]])
    assert torch.allclose(out[2].norm(), torch.tensor(4.0), atol=1e-5)
    assert torch.allclose(out[2], v / v.norm() * 4.0, atol=1e-6)
    assert torch.equal(embed_prompt(ids, W, None, None, 4.0), W[ids])


def test_embed_batch_matches_per_prompt_and_keeps_grad():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(40, 8)
    ids = torch.randint(0, 40, (3, 6))
    sites = torch.tensor([1, -1, 4])
    vecs = torch.randn(3, 8)
    out = embed_batch(ids, emb, sites, vecs, None)
    for b in range(3):
        ref = embed_prompt(ids[b], emb.weight, None if sites[b] < 0 else int(sites[b]), vecs[b], None)
        assert torch.allclose(out[b], ref)
    out.sum().backward()
    assert emb.weight.grad is not None


def test_karvonen_delta_norm_matches_stream():
    h = torch.randn(4, 32) * 3
    v = torch.randn(4, 32)
    d = karvonen_delta(h, v)
    assert torch.allclose(d.norm(dim=-1), h.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(torch.nn.functional.cosine_similarity(d, v), torch.ones(4), atol=1e-5)


def test_karvonen_apply_only_at_sites_and_not_in_decode():
    h = torch.randn(2, 5, 8)
    v = torch.randn(2, 8)
    out = karvonen_apply(h, torch.tensor([2, -1]), v)
    diff = (out - h).abs().sum(-1)
    assert diff[0, 2] > 0 and diff[0, [0, 1, 3, 4]].sum() == 0 and diff[1].sum() == 0
    one = torch.randn(2, 1, 8)
    assert karvonen_apply(one, torch.tensor([0, 0]), v) is one


def test_karvonen_hook_on_tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base = model(ids).logits
    hook = KarvonenHook(model, 1)
    hook.set(torch.tensor([2]), torch.randn(1, 64))
    injected = model(ids).logits
    hook.clear()
    assert torch.equal(model(ids).logits, base)
    assert torch.equal(injected[0, :2], base[0, :2])  # causal: positions before the site untouched
    assert not torch.allclose(injected[0, 2:], base[0, 2:])
    hook.set(torch.tensor([1, 2]), torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="armed for 2 rows"):
        model(ids)
    hook.remove()
    assert torch.equal(model(ids).logits, base)


def test_injection_vector_is_fp32_and_scaled():
    v = torch.randn(8, dtype=torch.bfloat16)
    out = injection_vector(v, 2.0)
    assert out.dtype == torch.float32 and abs(out.norm().item() - 2.0) < 1e-5


def test_an_adapter_trained_with_another_injection_is_refused_before_any_actor(tiny_dir, tmp_path):
    import json

    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.errors import NlaInputError
    from nla_grpo.shared.injection import INJECTION_RECORD, check_adapter_injection, injection_record

    def cfg(**injection):
        return build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                             "injection": injection, "learner": {"adapter_init": str(tmp_path)}}, "t")

    karvonen = cfg(mode="karvonen", karvonen_layer=1)
    (tmp_path / INJECTION_RECORD).write_text(json.dumps(injection_record(karvonen)))
    check_adapter_injection(tmp_path, karvonen)  # the same injection: accepted
    for other, field in ((cfg(mode="karvonen", karvonen_layer=0), "layer: the adapter was trained with 1, this run has "
                          "injection.karvonen_layer 0"), (cfg(), "mode: the adapter was trained with 'karvonen', this run "
                          "has injection.mode 'embed'")):
        with pytest.raises(NlaInputError, match=field):
            prepare_job(other, log=lambda m: None)  # before the data is read, before any actor
    (tmp_path / INJECTION_RECORD).unlink()  # the reference trainer's adapters carry no record
    seen = []
    check_adapter_injection(tmp_path, karvonen, log=seen.append)
    assert seen and "no nla_injection.json; assuming it was trained with this run's injection (mode karvonen, layer 1)" in seen[0]
