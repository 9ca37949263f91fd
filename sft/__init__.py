"""The SFT stages that come before RL: AV-SFT (``nla-grpo sft av``: the verbaliser learns to write the
teacher's explanation from the injected activation) and AR-SFT (``nla-grpo sft ar``: the reconstructor
learns to map the explanation back to the activation). Each writes what the RL config takes as it is:
``learner.adapter_init`` and ``critic.checkpoint``."""
