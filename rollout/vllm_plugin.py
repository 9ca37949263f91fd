"""vLLM plugin (entry point ``vllm.general_plugins``): registers the karvonen-injecting model classes.

vLLM runs ``register`` in every process it starts (the front end that resolves the architecture, the
engine core and each worker that builds the model), which is why the registration is a plugin and
not a call in the actor. Registering by ``module:Class`` name keeps this cheap: ``rollout.vllm_karvonen``
is imported only where a model is built.
"""
from __future__ import annotations


def register() -> None:
    from vllm import ModelRegistry

    from rollout.vllm_karvonen import ARCHITECTURES, PREFIX

    known = set(ModelRegistry.get_supported_archs())
    for arch in ARCHITECTURES:
        if PREFIX + arch not in known:
            ModelRegistry.register_model(PREFIX + arch, f"rollout.vllm_karvonen:{PREFIX + arch}")


def registered() -> bool:
    """Whether this process's vLLM knows the classes (the package's entry point is installed)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from rollout.vllm_karvonen import ARCHITECTURES, PREFIX

    load_general_plugins()
    return PREFIX + ARCHITECTURES[0] in set(ModelRegistry.get_supported_archs())
