"""The learner (activation verbaliser training): the PEFT policy with its frozen reference adapter, the GRPO
loss and reward maths, the packed micro-batched update and its memory plan, checkpoints; the Ray actor.

``learner`` holds ``Learner`` (the update, scoring, export), ``micro_batches`` the items and their
micro-batches (the token budget, packed or padded, dealt over the ranks), ``checkpoint`` a learner
checkpoint's layout, ``policy`` the model and its forward, ``packing`` and ``memory_plan`` the pure
planning maths, ``grpo`` and ``reward`` the loss and reward maths, ``lora_compute`` and ``token_logprobs``
the fast paths, ``actor`` the ``LearnerActor``.
"""
