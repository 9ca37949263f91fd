"""Rollout service: GRPO groups from the policy (vLLM fast path, HF generate() baseline).

- ``engine``: the ``RolloutEngine`` interface and the per-sample rules both backends share;
- ``vllm_engine`` / ``hf_engine``: the two backends; ``actor``: the Ray actor and ``make_engine``;
- ``adapter_registry``: how a pushed adapter version is registered with vLLM (file or in-memory); ``vllm_compat``: the one
  place that touches vLLM internals; ``embeddings``: reads only ``embed_tokens`` from a checkpoint;
"""
