"""Export -> vLLM: the rollout engine, running the learner's exported adapter, samples tokens whose
logprobs the learner reproduces (fp32, CPU, embed injection, LoRA), before and after a GRPO step."""
import pytest
import torch

from test_learner_support import load_tiny_spec, make_cfg, prompts_and_vectors


def _cfg(tiny_dir, transport):
    cfg = make_cfg(tiny_dir, "embed", lr=1e-2, micro_batch=8)
    from nla_grpo.shared.config import FileSync, HostSync

    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": 3, "max_new_tokens": 8}),
                                  "weight_sync": FileSync() if transport == "file" else HostSync()})


def _max_gap(learner, samples, vectors, adapter="default"):
    got = learner.logprobs(samples, vectors, adapter)
    return max(abs(a - b) for s, lp in zip(samples, got) for a, b in zip(s.logprobs, lp))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["memory", "file"])
def test_vllm_logprobs_equal_the_learners(tiny_dir, transport):
    pytest.importorskip("vllm")
    from nla_grpo.learner.grpo import group_advantages
    from nla_grpo.learner.learner import Learner
    from nla_grpo.rollout.vllm.engine import VllmEngine
    from nla_grpo.shared.types import PromptRequest

    cfg, spec = _cfg(tiny_dir, transport), load_tiny_spec(tiny_dir)
    learner = Learner(cfg, spec)
    rows = prompts_and_vectors(tiny_dir, 4)
    requests = [PromptRequest(row_id=i, prompt_ids=ids, site=site, vector=vec) for i, (ids, site, vec) in enumerate(rows)]
    engine = VllmEngine(cfg, spec, "cpu")
    try:
        engine.load_adapter(learner.export_adapter())  # v1 = the initial adapter
        samples = engine.generate(requests, seed=0)
        vectors = torch.stack([rows[s.row_id][2] for s in samples])
        assert sum(len(s.response_ids) for s in samples) > len(samples) and all(s.adapter_version == 1 for s in samples)
        assert _max_gap(learner, samples, vectors) <= 1e-4

        # one real GRPO step on those rollouts, then the new version must match too
        rewards = [sum(s.logprobs) for s in samples]  # any spread within each group will do
        adv = group_advantages(rewards, [s.row_id for s in samples]).tolist()
        metrics = learner.update(samples, adv, vectors)
        assert not metrics["skipped"] and metrics["masked"] == 0 and metrics["grad_norm"] > 0
        assert metrics["logprob_mismatch_mean_abs"] <= 1e-4 and metrics["logprob_mismatch_k3"] <= 1e-6
        update = learner.export_adapter()
        assert update.version == 2
        engine.load_adapter(update)
        samples = engine.generate(requests, seed=1)
        vectors = torch.stack([rows[s.row_id][2] for s in samples])
        assert all(s.adapter_version == 2 for s in samples)
        assert _max_gap(learner, samples, vectors) <= 1e-4
        # the adapter really changed the policy: the reference (initial) adapter scores these differently
        assert _max_gap(learner, samples, vectors, "reference") > 1e-2
    finally:
        engine.close()
