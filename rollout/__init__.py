"""Rollout service: GRPO groups from the policy (vLLM fast path, HF generate() baseline).

- ``engine``: the ``RolloutEngine`` interface and the per-sample rules both backends share;
- ``vllm/``: everything that touches vLLM (its engine, environment, worker-side LoRA and merge, patches, model
  classes and plugin, adapter registries); nothing outside it imports vLLM's internals;
- ``hf_engine``: the HF ``generate()`` backend; ``actor``: the Ray actor and ``make_engine``;
- ``embeddings``: reads only ``embed_tokens`` from a checkpoint; ``engine_plan``: the engine's memory and batch plan;
- ``seeded_noise``: the sampler's per-request noise in one kernel.
"""
