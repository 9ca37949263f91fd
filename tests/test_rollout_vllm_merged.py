"""rollout.lora: merged — each push folds the adapter into the vLLM engine's own weights: the rollout
matches the HF engine running the adapter as a LoRA (fp32, CPU), push after push, in both injection modes."""
import pytest

from rollout_support import max_abs_diff, random_adapter_update, tiny_config, tiny_requests, update_for, vectors_of
from nla_grpo.shared.spec import load_spec, sidecar_path

PARITY_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["embed", "karvonen"])
def test_merged_rollout_matches_the_adapter_push_after_push(tiny_dir, mode):
    pytest.importorskip("vllm")
    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.engine import VllmEngine

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
        # an adapter on some parts of the fused weights (PEFT's default q and v; up without gate): each delta on
        # its own rows, k and gate left at the base (the merge once put v's delta on k's rows)
        lc = cfg.learner
        partial = random_adapter_update(cfg.model.path, 3, 11, lc.lora_r, lc.lora_alpha, ["q_proj", "v_proj", "up_proj"],
                                        lc.use_rslora)
        engine.load_adapter(partial)
        hf.load_adapter(partial)
        assert engine.last_push["weights"] == 2 * 2  # qkv and gate_up in each block
        samples = engine.generate(reqs, seed=1)
        assert max_abs_diff(samples, hf.recompute_logprobs(samples, vectors_of(samples, reqs))) <= PARITY_ATOL
    finally:
        engine.close()
        hf.close()
        hf_base.close()


@pytest.mark.parametrize("change,why", [
    ({"rollout": {"backend": "hf"}}, "rollout.backend=hf"),
    ({"weight_sync": {"kind": "file"}}, "weight_sync.kind=file"),
    ({"placement": {"mode": "split"}, "rollout": {"tensor_parallel_size": 2}, "model": {"dtype": "bfloat16"}},
     "rollout.tensor_parallel_size=2"),
])
def test_merged_is_refused_where_it_cannot_merge(change, why):
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.errors import NlaInputError

    raw = {"rollout": {"lora": "merged"}}
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(NlaInputError, match=f"rollout.lora=merged with {why}"):
        build_config(raw)


def test_merged_with_nf4_runs_the_dequantised_base_unquantised_in_vllm(tiny_dir):
    """rollout.lora=merged with model.quantization nf4: vLLM is asked for no quantisation and planned with
    the weights in bf16; the engine sets its linears to the learner's NF4 base itself (GPU test)."""
    from nla_grpo.rollout.vllm.engine import engine_kwargs, weight_bytes
    from nla_grpo.shared.config import build_config

    raw = {"model": {"path": str(tiny_dir / "model"), "dtype": "bfloat16", "quantization": "nf4"},
           "placement": {"mode": "colocated"}}
    adapter = build_config({**raw, "rollout": {"lora": "adapter"}})
    merged = build_config({**raw, "rollout": {"lora": "merged"}})
    assert engine_kwargs(adapter, "cuda", "bfloat16", marker_id=7)["quantization"] == "bitsandbytes"
    assert "quantization" not in engine_kwargs(merged, "cuda", "bfloat16", marker_id=7)
    assert weight_bytes(merged) > 2.5 * weight_bytes(adapter)


def test_each_part_of_a_fused_weight_has_its_own_rows():
    """``worker_lora.part_rows``: from the fused layer's part sizes (q 4, k 2, v 2 rows), the rows each present part
    takes; a weight that is no fusion is one part; parts that do not match the weight are refused."""
    import types

    import torch

    from nla_grpo.rollout.vllm.worker_lora import part_rows

    qkv, w = types.SimpleNamespace(output_sizes=[4, 2, 2]), torch.zeros(8, 3)
    q_and_v = {0: (None, torch.zeros(4, 1), 1.0), 2: (None, torch.zeros(2, 1), 1.0)}
    assert part_rows(qkv, w, q_and_v) == {0: (0, 4), 1: (4, 2), 2: (6, 2)}
    assert part_rows(types.SimpleNamespace(), w, {0: (None, torch.zeros(8, 1), 1.0)}) == {0: (0, 8)}
    with pytest.raises(RuntimeError, match=r"parts \[0, 2\] of \[8\] rows do not match"):
        part_rows(None, w, q_and_v)  # no part sizes given: one part, which q and v cannot both be
    with pytest.raises(RuntimeError, match="do not match a weight of 9 rows"):
        part_rows(qkv, torch.zeros(9, 3), q_and_v)


def coarse_roundtrip(w):
    """A stand-in for NF4's quantise-dequantise that, like double quantisation, depends on the whole tensor
    it is given (its largest magnitude): a fused weight rounded at once would differ from its parts."""
    import torch

    step = w.abs().max() / 8
    return torch.round(w / step) * step


def test_a_fused_weight_is_rounded_part_by_part():
    import torch

    from nla_grpo.shared.quantization import roundtrip_by_parts

    torch.manual_seed(0)
    q, k = torch.randn(6, 4), torch.randn(2, 4) * 10
    fused = torch.cat([q, k])
    parts = roundtrip_by_parts(fused, [6, 2], coarse_roundtrip)
    assert torch.equal(parts, torch.cat([coarse_roundtrip(q), coarse_roundtrip(k)]))
    assert not torch.equal(parts, coarse_roundtrip(fused))
    with pytest.raises(ValueError, match="parts of \\[6, 3\\] rows do not make a weight of 8 rows"):
        roundtrip_by_parts(fused, [6, 3], coarse_roundtrip)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_engine_base_rounded_module_by_module_matches_hf_with_the_same_weights(tiny_dir, tmp_path):
    """``worker_lora.nf4_base_in_worker`` on a CPU engine, with ``coarse_roundtrip`` for bitsandbytes' NF4
    (CUDA only): every linear is rounded as the learner's separate modules are (q, k, v; gate, up on their
    own), the LM head and embeddings are not, and an adapter merged later folds into the rounded base. The
    rollout matches an HF model whose q/k/v/o/gate/up/down weights were rounded one by one (fp32, 1e-4)."""
    pytest.importorskip("vllm")
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.handles import worker_model
    from nla_grpo.rollout.vllm.worker_lora import linear_parts, nf4_base_in_worker
    from nla_grpo.rollout.vllm.engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    cfg = tiny_config(tiny_dir, None, group_size=4, max_new_tokens=16, lora="merged")
    rounded_dir = tmp_path / "rounded"
    shutil.copytree(tiny_dir / "model", rounded_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", dtype=torch.float32)
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in leaves:
                module.weight.copy_(coarse_roundtrip(module.weight))
    model.save_pretrained(rounded_dir)
    rounded = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(rounded_dir)})})
    engine, hf, hf_plain = VllmEngine(cfg, spec), HfEngine(rounded, spec), HfEngine(cfg, spec)
    try:
        c = model.config
        parts = engine.llm.collective_rpc(lambda w: linear_parts(worker_model(w)))[0]
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        assert parts == {name: sizes for i in range(c.num_hidden_layers) for name, sizes in (
            (f"model.layers.{i}.self_attn.qkv_proj", [q, kv, kv]), (f"model.layers.{i}.self_attn.o_proj", [c.hidden_size]),
            (f"model.layers.{i}.mlp.gate_up_proj", [inter, inter]), (f"model.layers.{i}.mlp.down_proj", [c.hidden_size]))}
        done = engine.llm.collective_rpc(nf4_base_in_worker, args=(coarse_roundtrip,))[0]
        assert done["weights"] == 4 * c.num_hidden_layers
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 4, prefill=cfg.rollout.prefill)
        for version in (0, 1, 2):
            if version:
                update = update_for(cfg, version, seed=version)
                engine.load_adapter(update)
                hf.load_adapter(update)
            samples = engine.generate(reqs, seed=3)
            assert max_abs_diff(samples, hf.recompute_logprobs(samples, vectors_of(samples, reqs))) <= PARITY_ATOL
        # the rounding is in the engine's base: the unrounded model's logprobs of these tokens are far off
        hf_plain.load_adapter(update)
        assert max_abs_diff(samples, hf_plain.recompute_logprobs(samples, vectors_of(samples, reqs))) > 1e-2
        with pytest.raises(RuntimeError, match="the NF4 base must be set before the first merge"):
            engine.llm.collective_rpc(nf4_base_in_worker, args=(coarse_roundtrip,))
    finally:
        engine.close()
        hf.close()
        hf_plain.close()
