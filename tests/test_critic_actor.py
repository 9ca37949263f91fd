"""The critic's Ray actor gives the same answers as the in-process service."""
import json

import pytest
import torch

from nla_grpo.shared.config import build_config
from nla_grpo.shared.data import read_rows
from nla_grpo.shared.spec import load_spec

pytestmark = pytest.mark.slow


def test_actor_matches_in_process(tiny_dir, tmp_path):
    import ray

    from nla_grpo.critic.actor import CriticActor
    from nla_grpo.shared.actors import remote
    from nla_grpo.critic.scoring import Critic

    spec = load_spec(tiny_dir / "rl.parquet.nla_meta.yaml")
    cfg = build_config({"model": {"path": str(tiny_dir / "model"), "dtype": "float32"},
                        "critic": {"train": True, "lr": 1e-3, "micro_batch": 4}})
    golds = torch.from_numpy(read_rows(tiny_dir / "rl.parquet", spec.d_model, max_rows=8).activations)
    topics = json.loads((tiny_dir / "topics.json").read_text())[:8]
    explanations = [None if i == 2 else f"{t} " * (1 + i % 3) for i, t in enumerate(topics)]

    local = Critic(cfg, spec)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = remote(CriticActor).options(num_cpus=1, num_gpus=0).remote(cfg, spec, "cpu")
        remote_scores = ray.get(actor.score.remote(explanations, golds))
        local_scores = local.score(explanations, golds)
        assert remote_scores[2] is None and local_scores[2] is None
        for a, b in zip(remote_scores, local_scores):
            if b is not None:
                assert a == pytest.approx(b, abs=1e-5)

        remote_step = ray.get(actor.train_step.remote(explanations, golds))
        local_step = local.train_step(explanations, golds)
        assert remote_step["critic_n"] == local_step["critic_n"] == 7
        assert remote_step["critic_loss"] == pytest.approx(local_step["critic_loss"], abs=1e-5)

        ray.get(actor.save.remote(str(tmp_path / "ck")))
        reloaded = Critic(cfg, spec)
        reloaded.load(tmp_path / "ck", require_optimizer=True)
        after = ray.get(actor.score.remote(explanations, golds))
        for a, b in zip(after, reloaded.score(explanations, golds)):
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-6)
    finally:
        ray.shutdown()
