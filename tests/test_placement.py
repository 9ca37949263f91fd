"""Placement on a Ray cluster with logical GPUs (no CUDA needed): who lands where, and the loop on top."""
import os
import time

import pytest

from nla_grpo.orchestrator.job import absolute_paths, prepare_job
from nla_grpo.orchestrator.placement import gpu_count_needed, start_services, stop_services
from nla_grpo.orchestrator.run_dir import RunDir
from nla_grpo.shared.config import build_config

from conftest import ROOT
from test_driver_failures import FakeCritic, FakeLearner, FakeRollout

pytestmark = pytest.mark.timeout(300)


class WhereRollout(FakeRollout):
    def __init__(self, cfg, spec, backend, device):
        self.started_at = time.time()
        time.sleep(0.5)  # an engine takes a while to come up
        super().__init__(cfg.rollout.group_size)
        self.device, self.ready_at = device, time.time()

    def where(self):
        import ray

        return self.device, sorted(ray.get_gpu_ids()), self.ready_at

    def started(self):
        return self.started_at


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


@pytest.mark.parametrize("engines", [1, 2])
def test_colocated_shares_one_gpu(ray_gpus, tiny_dir, engines):
    cfg = _cfg(tiny_dir, {"mode": "colocated"}, num_engines=engines)
    assert gpu_count_needed(cfg) == 1
    s = start_services(cfg, None, _classes(ray_gpus))
    try:
        places = ray_gpus.get([r.where.remote() for r in s.rollouts])
        started = ray_gpus.get([r.started.remote() for r in s.rollouts])
        (lgpu, learner_started), cgpu = ray_gpus.get([s.learner.leader.where.remote(), s.critic.leader.where.remote()])
        assert len(places) == engines and all(device == "cuda" and ids == lgpu == cgpu for device, ids, _ in places)
        assert len(lgpu) == 1
        # vLLM profiles its memory share alone: each engine starts once the one before is up, the learner last
        ready = [ready_at for _, _, ready_at in places]
        assert all(later >= ready[i] for i, later in enumerate(started[1:]))
        assert learner_started >= ready[-1]
    finally:
        stop_services(s)


def test_split_gives_engines_their_own_gpus_and_the_loop_runs(ray_gpus, tiny_dir, tmp_path):
    from nla_grpo.orchestrator.driver import train

    # logical GPUs without CUDA: the push goes through host memory (NCCL, split's default, needs real GPUs)
    cfg = _cfg(tiny_dir, {"mode": "split", "learner_gpus": 1, "critic_own_gpu": True}, "host", num_engines=2)
    assert gpu_count_needed(cfg) == 4
    s = start_services(cfg, None, _classes(ray_gpus))
    try:
        places = ray_gpus.get([r.where.remote() for r in s.rollouts])
        (lgpu, _), cgpu = ray_gpus.get([s.learner.leader.where.remote(), s.critic.leader.where.remote()])
        gpus = [g for _, ids, _ in places for g in ids] + lgpu + cgpu
        assert len(gpus) == 4 and len(set(gpus)) == 4  # every service on its own GPU
        # round-robin over two engines: 5 prompts split 3 + 2, samples come back in request order
        job = prepare_job(cfg, log=lambda m: None)
        run = RunDir.create(tmp_path / "run", cfg)
        last = train(job, run, s, log=lambda m: None)
        assert last["step"] == 3 and last["adapter_version"] == 4
        from nla_grpo.orchestrator.driver import _requests
        from nla_grpo.orchestrator.rollout_feed import rollout

        reqs = _requests(job, job.train, job.prompt_index_train, [4, 0, 3, 1, 2])
        samples = rollout(s.rollouts, reqs, seed=0)
        assert [(x.row_id, x.group_index) for x in samples] == [(r.row_id, g) for r in reqs for g in range(2)]
    finally:
        stop_services(s)


def test_split_needs_enough_gpus(ray_gpus, tiny_dir):
    cfg = _cfg(tiny_dir, {"mode": "split", "learner_gpus": 1, "critic_own_gpu": True}, num_engines=3)
    with pytest.raises(RuntimeError, match="needs 5 GPU"):
        start_services(cfg, None, _classes(ray_gpus))


@pytest.mark.parametrize("own,gpus", [(False, 3), (True, 4)])
def test_data_parallel_ranks_get_a_gpu_each_and_critics_sit_beside_them(ray_gpus, tiny_dir, tmp_path, own, gpus):
    from nla_grpo.orchestrator.driver import train

    cfg = _cfg(tiny_dir, {"mode": "split", "learner_workers": 2, "critic_workers": 2 if not own else 1, "critic_own_gpu": own},
               "host", num_engines=1)
    assert gpu_count_needed(cfg) == gpus
    s = start_services(cfg, None, _classes(ray_gpus))
    try:
        assert len(s.learner.actors) == 2 and len(s.critic.actors) == cfg.placement.critic_workers
        learner_gpus = [ray_gpus.get(a.where.remote())[0] for a in s.learner.actors]
        critic_gpus = [ray_gpus.get(a.where.remote()) for a in s.critic.actors]
        (_, engine_gpus, _), = ray_gpus.get([r.where.remote() for r in s.rollouts])
        assert all(len(g) == 1 for g in learner_gpus) and len({g[0] for g in learner_gpus}) == 2
        assert not set(engine_gpus) & {g[0] for g in learner_gpus + critic_gpus}
        if own:
            assert not {g[0] for g in critic_gpus} & {g[0] for g in learner_gpus}
        else:
            assert critic_gpus == learner_gpus  # critic rank i beside learner rank i
        job = prepare_job(cfg, log=lambda m: None)
        last = train(job, RunDir.create(tmp_path / "run", cfg), s, log=lambda m: None)
        assert last["step"] == 3
        # 5 prompts x 2 samples per step: every rank gets the whole batch (and runs its share of its micro-batches)
        assert ray_gpus.get([a.shard_sizes.remote() for a in s.learner.actors]) == [[10, 10, 10], [10, 10, 10]]
    finally:
        stop_services(s)
