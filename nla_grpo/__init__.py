"""Use a trained NLA: ``NLA.load(run_dir)`` reads activations into explanations and scores them."""
from nla_grpo.nla import NLA

__all__ = ["NLA"]
