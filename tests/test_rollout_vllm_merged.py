"""rollout.lora: merged — each push folds the adapter into the vLLM engine's own weights: the rollout
matches the HF engine running the adapter as a LoRA (fp32, CPU), push after push, in both injection modes."""
import pytest

from rollout_support import max_abs_diff, tiny_config, tiny_requests, update_for, vectors_of
from shared.spec import load_spec, sidecar_path

PARITY_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["embed", "karvonen"])
def test_merged_rollout_matches_the_adapter_push_after_push(tiny_dir, mode):
    pytest.importorskip("vllm")
    from rollout.hf_engine import HfEngine
    from rollout.vllm_engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    injection = {"mode": "karvonen", "karvonen_layer": 0} if mode == "karvonen" else None
    cfg = tiny_config(tiny_dir, injection, group_size=4, max_new_tokens=16, lora="merged")
    engine, hf, hf_base = VllmEngine(cfg, spec), HfEngine(cfg, spec), HfEngine(cfg, spec)
    try:
        assert "enable_lora" not in engine.plan_kwargs  # no LoRA in the engine at all
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 4, prefill=cfg.rollout.prefill)
        base = engine.generate(reqs, seed=1)
        assert max_abs_diff(base, hf.recompute_logprobs(base, vectors_of(base, reqs))) <= PARITY_ATOL
        for version, seed in ((1, 4), (2, 9)):  # the second push starts from the base, not from version 1
            update = update_for(cfg, version, seed=seed)
            engine.load_adapter(update)
            hf.load_adapter(update)
            assert engine.last_push["weights"] == 2 * 4  # qkv, o, gate_up, down in each of the two blocks
            samples = engine.generate(reqs, seed=1)
            assert {s.adapter_version for s in samples} == {version}
            assert max_abs_diff(samples, hf.recompute_logprobs(samples, vectors_of(samples, reqs))) <= PARITY_ATOL
            # the adapter is in the weights: the base model's own logprobs of these tokens are far from them
            assert max_abs_diff(samples, hf_base.recompute_logprobs(samples, vectors_of(samples, reqs))) > 1e-2
        again = engine.generate(reqs[:1], seed=1)
        assert [s.response_ids for s in again] == [s.response_ids for s in samples[:4]]
    finally:
        engine.close()
        hf.close()
        hf_base.close()


@pytest.mark.parametrize("change,why", [
    ({"rollout": {"backend": "hf"}}, "rollout.backend=hf"),
    ({"weight_sync": {"kind": "file"}}, "weight_sync.kind=file"),
    ({"placement": {"mode": "split"}, "rollout": {"tensor_parallel_size": 2}, "model": {"dtype": "bfloat16"}},
     "rollout.tensor_parallel_size=2"),
    ({"placement": {"mode": "colocated"}, "model": {"quantization": "nf4", "dtype": "bfloat16"}}, "model.quantization=nf4"),
])
def test_merged_is_refused_where_it_cannot_merge(change, why):
    from shared.config import build_config
    from shared.errors import NlaInputError

    raw = {"rollout": {"lora": "merged"}}
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(NlaInputError, match=f"rollout.lora=merged with {why}"):
        build_config(raw)
