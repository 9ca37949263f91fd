"""Placement on a Ray cluster with logical GPUs (no CUDA needed): who lands where, and the loop on top."""
import os
import time

import pytest

from orchestrator.job import absolute_paths, prepare_job
from orchestrator.placement import gpu_count_needed, start_services, stop_services
from orchestrator.run_dir import RunDir
from shared.config import build_config

from conftest import ROOT
from test_driver_failures import FakeCritic, FakeLearner, FakeRollout

pytestmark = pytest.mark.timeout(300)


class WhereRollout(FakeRollout):
    def __init__(self, cfg, spec, backend, device):
        time.sleep(0.5)  # an engine takes a while to come up
        super().__init__(cfg.rollout.group_size)
        self.device, self.ready_at = device, time.time()

    def where(self):
        import ray

        return self.device, sorted(ray.get_gpu_ids()), self.ready_at


class WhereLearner(FakeLearner):
    def __init__(self, cfg, spec, device):
        super().__init__()
        self.started_at = time.time()

    def where(self):
        import ray

        return sorted(ray.get_gpu_ids()), self.started_at


class WhereCritic(FakeCritic):
    def __init__(self, cfg, spec, device):
        super().__init__()

    def where(self):
        import ray

        return sorted(ray.get_gpu_ids())


@pytest.fixture(scope="module")
def ray_gpus():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}})
    yield ray
    ray.shutdown()


def _cfg(tiny_dir, placement, weight_sync="auto", **rollout):
    cfg = build_config({"model": {"path": str(tiny_dir / "model")}, "data": {"parquet": str(tiny_dir / "rl.parquet")},
                        "rollout": {"group_size": 2, **rollout}, "grpo": {"steps": 3, "prompts_per_step": 5},
                        "placement": placement, "weight_sync": {"kind": weight_sync},
                        "logging": {"eval_every": 0}, "checkpointing": {"every": 0}}, "test")
    return absolute_paths(cfg, ROOT)


def _classes(ray):
    return WhereRollout, WhereLearner, WhereCritic


def test_colocated_shares_one_gpu(ray_gpus, tiny_dir):
    cfg = _cfg(tiny_dir, {"mode": "colocated"})
    assert gpu_count_needed(cfg) == 1
    s = start_services(cfg, None, _classes(ray_gpus))
    try:
        (device, rgpu, ready_at), = ray_gpus.get([r.where.remote() for r in s.rollouts])
        (lgpu, learner_started), cgpu = ray_gpus.get([s.learner.where.remote(), s.critic.where.remote()])
        assert device == "cuda" and len(rgpu) == 1 and rgpu == lgpu == cgpu
        assert learner_started >= ready_at  # vLLM profiles its memory share before the learner loads
    finally:
        stop_services(s)


def test_split_gives_engines_their_own_gpus_and_the_loop_runs(ray_gpus, tiny_dir, tmp_path):
    from orchestrator.driver import train

    # logical GPUs without CUDA: the push goes through host memory (NCCL, split's default, needs real GPUs)
    cfg = _cfg(tiny_dir, {"mode": "split", "learner_gpus": 1, "critic_own_gpu": True}, "host", num_engines=2)
    assert gpu_count_needed(cfg) == 4
    s = start_services(cfg, None, _classes(ray_gpus))
    try:
        places = ray_gpus.get([r.where.remote() for r in s.rollouts])
        (lgpu, _), cgpu = ray_gpus.get([s.learner.where.remote(), s.critic.where.remote()])
        gpus = [g for _, ids, _ in places for g in ids] + lgpu + cgpu
        assert len(gpus) == 4 and len(set(gpus)) == 4  # every service on its own GPU
        # round-robin over two engines: 5 prompts split 3 + 2, samples come back in request order
        job = prepare_job(cfg, log=lambda m: None)
        run = RunDir.create(tmp_path / "run", cfg)
        last = train(job, run, s, log=lambda m: None)
        assert last["step"] == 2 and last["adapter_version"] == 4
        from orchestrator.driver import _requests
        from orchestrator.rollout_feed import rollout

        reqs = _requests(job, job.train, job.prompt_index_train, [4, 0, 3, 1, 2])
        samples = rollout(s.rollouts, reqs, seed=0)
        assert [(x.row_id, x.group_index) for x in samples] == [(r.row_id, g) for r in reqs for g in range(2)]
    finally:
        stop_services(s)


def test_split_needs_enough_gpus(ray_gpus, tiny_dir):
    cfg = _cfg(tiny_dir, {"mode": "split", "learner_gpus": 1, "critic_own_gpu": True}, num_engines=3)
    with pytest.raises(RuntimeError, match="needs 5 GPU"):
        start_services(cfg, None, _classes(ray_gpus))
