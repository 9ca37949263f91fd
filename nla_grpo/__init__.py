"""nla-grpo, one installed package: ``NLA.load(run_dir)`` reads activations into explanations and scores them, and
the trainer's parts live under it (``nla_grpo.shared``, ``.dataprep``, ``.sft``, ``.rollout``, ``.critic``,
``.learner``, ``.orchestrator``, ``.evals``).

In the repository those parts are folders at its top, next to this one (an installed wheel holds them inside
``nla_grpo/``): a checkout's ``nla_grpo`` finds them there. ``NLA`` is imported on first use, so importing a part
(vLLM's plugin loader imports ``nla_grpo.rollout.vllm.plugin``) does not import torch.
"""
from pathlib import Path as _Path

_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "shared" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's own __path__

__all__ = ["NLA"]


def __getattr__(name: str):
    if name == "NLA":
        from nla_grpo.nla import NLA

        return NLA
    raise AttributeError(f"module 'nla_grpo' has no attribute {name!r}")
