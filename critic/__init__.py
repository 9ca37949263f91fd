"""The critic (activation reconstructor): truncated backbone + value head, batched scoring, co-training.

``model`` builds the network, ``checkpoint`` reads and writes AR checkpoint directories, ``scoring``
holds the in-process ``Critic`` and ``actor`` its Ray actor ``CriticActor``.
"""
