"""vLLM plugin (entry point ``vllm.general_plugins``): registers the karvonen-injecting model classes and the
classes that read the injected row as a multimodal item (``rollout.vllm.marker_input``).

vLLM runs ``register`` in every process it starts (the front end that resolves the architecture, the
engine core and each worker that builds the model), which is why the registration is a plugin and
not a call in the actor. Registering by ``module:Class`` name keeps this cheap: ``rollout.vllm.karvonen``
is imported only where a model is built.
"""
from __future__ import annotations


def register() -> None:
    """Never raises: vLLM does not catch a plugin's error, so one here would stop every engine in this
    environment, other projects' too. Without the classes a karvonen engine says so in one line.
    In the processes of engines this project started it also applies
    ``rollout.vllm.patches.engine_patches``; other programs' vLLM stays as it is."""
    import os

    from nla_grpo.rollout.vllm import env, patches  # standard library only: importing it cannot fail where this module loads

    if os.environ.get(env.OUR_ENGINE) == "1":
        patches.engine_patches()  # never raises either
    if os.environ.get(env.CPU_LINEARS_KEEP) == "1":
        try:  # a merged CPU engine whose engine core runs in this process
            env.keep_cpu_linear_weights()
        except Exception as exc:  # noqa: BLE001 - see the docstring; the merge then fails in one line
            import logging

            logging.getLogger(__name__).warning("nla-grpo: CPU linears keep no weights (%s: %s)", type(exc).__name__, exc)
    try:
        from vllm import ModelRegistry

        from nla_grpo.rollout.vllm import marker_input as marker
        from nla_grpo.rollout.vllm.karvonen import ARCHITECTURES, PREFIX

        known = set(ModelRegistry.get_supported_archs())
        for module, names in (("nla_grpo.rollout.vllm.karvonen", [PREFIX + arch for arch in ARCHITECTURES]),
                              (marker.__name__, marker.CLASS_NAMES)):
            for name in names:
                if name not in known:
                    ModelRegistry.register_model(name, f"{module}:{name}")
    except Exception as exc:  # noqa: BLE001 - see the docstring
        import logging

        logging.getLogger(__name__).warning(
            "nla-grpo: the karvonen and marker-input model classes are not registered (%s: %s)", type(exc).__name__, exc)


def registered() -> bool:
    """Whether this process's vLLM knows the classes (the package's entry point is installed)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from nla_grpo.rollout.vllm.karvonen import ARCHITECTURES, PREFIX

    load_general_plugins()
    return PREFIX + ARCHITECTURES[0] in set(ModelRegistry.get_supported_archs())
