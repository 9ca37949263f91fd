"""GPU-only checks (skipped without CUDA + vLLM): bf16 rollout/learner parity through both push routes."""
import pytest
import torch

from rollout.testing import tiny_config, tiny_requests
from shared.config import build_config
from shared.spec import load_spec, sidecar_path

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("transport", ["memory", "file"])
def test_bf16_vllm_matches_learner_after_each_push(tiny_dir, transport):
    pytest.importorskip("vllm")
    from learner.service import Learner
    from rollout.vllm_engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    base = tiny_config(tiny_dir, group_size=4, max_new_tokens=24, weight_transport=transport,
                       gpu_memory_utilization=0.2, enforce_eager=True)
    raw = base.model_dump(mode="python")
    raw["model"]["dtype"] = "bfloat16"
    raw["learner"].update(lr=5e-2, optimizer="adamw")
    cfg = build_config(raw, "gpu-test")
    learner = Learner(cfg, spec, "cuda")
    engine = VllmEngine(cfg, spec, "cuda")  # a separate engine-core process: the bytes route
    try:
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 8, prefill=cfg.rollout.prefill)
        by_row = {r.row_id: r.vector for r in reqs}
        for step in range(3):
            engine.load_adapter(learner.export_adapter())
            samples = engine.generate(reqs, seed=step)
            assert {s.adapter_version for s in samples} == {learner.version}
            vectors = torch.stack([torch.as_tensor(by_row[s.row_id]) for s in samples])
            ours = learner.logprobs(samples, vectors)
            d = torch.cat([torch.tensor(s.logprobs) - torch.tensor(l) for s, l in zip(samples, ours)])
            k3 = (torch.exp(-d) + d - 1).mean().item()
            print(f"{transport} v{learner.version}: mean |dlogp| {d.abs().mean():.2e}, max {d.abs().max():.2e}, k3 {k3:.2e}")
            assert d.abs().mean() < 0.05 and k3 < 0.01
            adv = torch.randn(len(samples)).tolist()
            learner.update(samples, adv, vectors)
    finally:
        engine.close()
