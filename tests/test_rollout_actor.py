"""The rollout service through a Ray actor behaves exactly as the engine in-process."""
import pytest

from rollout_support import tiny_config, tiny_requests, update_for
from nla_grpo.shared.spec import load_spec, sidecar_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def samples_key(samples):
    return [(s.row_id, s.group_index, s.response_ids, s.finish_reason, s.adapter_version, s.text) for s in samples]


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_actor_matches_in_process_engine(ray_session, tiny_dir, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    from nla_grpo.rollout.actor import RolloutActor, make_engine
    from nla_grpo.shared.actors import remote
    from nla_grpo.shared.weight_sync import make_sender

    ray = ray_session
    spec = load_spec(sidecar_path(tiny_dir / "rl.parquet"))
    cfg = tiny_config(tiny_dir, group_size=4, max_new_tokens=16)
    local = make_engine(cfg, spec, "cpu", backend)
    actor = remote(RolloutActor).options(num_cpus=1, num_gpus=0).remote(cfg, spec, backend, "cpu")
    try:
        reqs = tiny_requests(tiny_dir / "rl.parquet", spec, local.tokenizer, 3, prefill=cfg.rollout.prefill)
        assert ray.get(actor.adapter_version.remote(), timeout=300) == 0
        for version in (None, 1, 2):
            if version is not None:
                update = update_for(cfg, version, seed=version)
                local.load_adapter(update)
                message = make_sender(cfg.weight_sync).export(update)  # as the learner's actor sends it
                assert ray.get(actor.load_adapter.remote(message), timeout=300) == version
            remote = ray.get(actor.generate.remote(reqs, 7), timeout=300)
            here = local.generate(reqs, 7)
            assert samples_key(remote) == samples_key(here)
            worst = max(abs(a - b) for r, h in zip(remote, here) for a, b in zip(r.logprobs, h.logprobs))
            assert worst <= 1e-5
            assert {s.adapter_version for s in remote} == {version or 0}
        assert ray.get(actor.adapter_version.remote(), timeout=60) == 2
    finally:
        ray.get(actor.close.remote(), timeout=120)
        ray.kill(actor)
        local.close()
