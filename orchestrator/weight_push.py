"""The controller's half of the weight sync (``shared.weight_sync``): the same calls for every variant.

``AdapterPush(learner, engines)()`` exports the learner's adapter once and loads it into every engine;
the first call first connects the learner and the engines (a private broadcast group, for
``broadcast``). The message stays a Ray object reference: the engines read it straight from the
learner's store, never through this process.
"""
from __future__ import annotations


class AdapterPush:
    """Pushes the learner actor's current adapter to the rollout actors; returns the version they hold."""

    def __init__(self, learner, engines):
        self.learner, self.engines = learner, list(engines)
        self.connected = False

    def connect(self) -> None:
        """The learner (rank 0) and every engine (ranks 1..n) meet, all at the same time."""
        import ray

        rendezvous = ray.get(self.learner.weight_sync_rendezvous.remote(1 + len(self.engines)))
        ray.get([self.learner.connect_weight_sync.remote(rendezvous)]
                + [eng.connect_weight_sync.remote(rendezvous, rank) for rank, eng in enumerate(self.engines, start=1)])
        self.connected = True

    def __call__(self) -> int:
        import ray

        if not self.connected:
            self.connect()
        message = self.learner.export_adapter.remote()
        loads = [eng.load_adapter.remote(message) for eng in self.engines]
        waiting = loads + [self.learner.send_adapter.remote(message)]
        while waiting:  # the first failure raises at once (a broadcast partner may be left waiting on it)
            done, waiting = ray.wait(waiting, num_returns=1)
            ray.get(done)
        versions = ray.get(loads)
        if len(set(versions)) != 1:
            raise RuntimeError(f"engines report different adapter versions after a push: {versions}")
        ray.get(self.learner.release_export.remote(versions[0]))  # every engine holds its copy now
        return versions[0]
