"""The learner (activation verbaliser training): the PEFT policy with its frozen reference adapter, the GRPO
loss and reward maths, the packed micro-batched update and its memory plan, checkpoints; the Ray actor.

``service`` holds ``Learner`` (the update, export and checkpoints), ``policy`` the model and its forward,
``packing`` and ``memory_plan`` the micro-batches, ``grpo`` and ``reward`` the pure maths, ``lora_compute``
and ``token_logprobs`` the fast paths, ``actor`` the ``LearnerActor``.
"""
