"""The file adapter route (PEFT directory in a node-local temp dir): delivery, parity, retirement."""
import pytest

from rollout_support import max_abs_diff, tiny_config, tiny_requests, update_for
from nla_grpo.shared.spec import load_spec, sidecar_path

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_dir):
    from nla_grpo.rollout.hf_engine import HfEngine
    from nla_grpo.rollout.vllm.engine import VllmEngine

    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    cfg = tiny_config(tiny_dir, group_size=4, max_new_tokens=24, weight_sync="file", max_loras=2)
    engine, hf = VllmEngine(cfg, spec), HfEngine(cfg, spec)
    reqs = tiny_requests(tiny_dir / "rl.parquet", spec, engine.tokenizer, 4, prefill=cfg.rollout.prefill)
    yield engine, hf, reqs
    engine.close()
    hf.close()


def test_file_route_delivers_each_version(setup):
    from nla_grpo.rollout.vllm.adapter_registry import ADAPTER_CONFIG, ADAPTER_WEIGHTS, FileRegistry

    engine, hf, reqs = setup
    assert isinstance(engine.registry, FileRegistry)
    vectors = lambda samples: [reqs[s.row_id].vector for s in samples]  # noqa: E731
    base = engine.generate(reqs, seed=4)
    for version in (1, 2):
        update = update_for(engine.cfg, version, seed=10 + version)
        engine.load_adapter(update)
        path = engine.registry.root / f"policy-v{version}"
        assert (path / ADAPTER_WEIGHTS).is_file() and (path / ADAPTER_CONFIG).is_file()
        out = engine.generate(reqs, seed=4)
        assert {s.adapter_version for s in out} == {version}
        # before HF has this version its scores differ; after, they match: the weights arrived
        assert max_abs_diff(out, hf.recompute_logprobs(out, vectors(out))) > 0.05
        hf.load_adapter(update)
        assert max_abs_diff(out, hf.recompute_logprobs(out, vectors(out))) <= PARITY_ATOL
        assert [s.logprobs for s in out] != [s.logprobs for s in base]


def test_file_route_retires_old_directories(setup):
    engine, _, reqs = setup
    start = engine.adapter_version
    for v in range(start + 1, start + 4):
        engine.load_adapter(update_for(engine.cfg, v, seed=v))
    last = start + 3
    assert sorted(p.name for p in engine.registry.root.iterdir()) == [f"policy-v{last - 1}", f"policy-v{last}"]
    assert engine.llm.llm_engine.list_loras() <= {last - 1, last}
    assert {s.adapter_version for s in engine.generate(reqs[:1], seed=0)} == {last}
    root = engine.registry.root
    engine.registry.close()
    assert not root.exists()
