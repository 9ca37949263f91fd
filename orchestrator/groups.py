"""The learner's and the critic's data-parallel ranks as one object each, for the driver.

A group of N rank actors (``LearnerActor`` / ``CriticActor``) joins one torch.distributed process
group at start (NCCL on GPUs, gloo on the CPU; addresses from Ray, so ranks may sit on several
nodes). Each call hands every rank the whole batch (one object in Ray's store, read by all); each
rank makes the micro-batch plan one rank would make and runs its share of the micro-batches
(``shared.collective.deal_micro_batches``: by tokens, so ranks are balanced; a GRPO group may span
ranks, the advantages were computed before). On several ranks gradients are summed in float64 over
micro-batches and ranks, so the update is the one a single rank computes with the same micro-batches,
to fp32 rounding. Calls run on every rank at once and return rank 0's answer, whose sums already
cover every rank. Rank 0 exports the adapter and writes checkpoints into the run
directory (which every node must see: ``check_run_dir_visible``); every rank loads them.

A rank that dies or raises stops the call with one line naming the group and the rank
(``RankFailure``); a rank whose trained state differs from rank 0's at a checkpoint too.
"""
from __future__ import annotations


GRACE_S = 5.0  # after a rank fails, how long to wait for a rank that died to be reported as the cause


class RankFailure(RuntimeError):
    """One rank of a data-parallel group failed; the message is one line naming it."""


class RankGroup:
    """N rank actors driven in lockstep."""

    name = "rank"

    def __init__(self, actors: list, backend: str = "gloo"):
        self.actors, self.backend = list(actors), backend
        self.joined = len(self.actors) == 1

    @property
    def leader(self):
        return self.actors[0]

    def wait_all(self, calls: list) -> list:
        """Wait for one call per rank; the first failure raises at once (the others may be stuck in a
        collective waiting for it). A rank that died is named before one whose collective broke with it."""
        import ray
        import ray.exceptions

        index = {ref: r for r, ref in enumerate(calls)}
        waiting = list(calls)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            try:
                ray.get(done)
            except Exception as exc:
                failures = [(index[done[0]], exc)]
                if not isinstance(exc, ray.exceptions.RayActorError) and waiting:
                    late, _ = ray.wait(waiting, num_returns=len(waiting), timeout=GRACE_S)
                    for ref in late:
                        try:
                            ray.get(ref)
                        except Exception as other:
                            failures.append((index[ref], other))
                dead = [(r, e) for r, e in failures if isinstance(e, ray.exceptions.RayActorError)]
                r, exc = (dead or failures)[0]
                raise RankFailure(self._describe(r, exc)) from None
        return ray.get(list(calls))

    def _describe(self, rank: int, exc: Exception) -> str:
        import ray.exceptions

        from nla_grpo.shared.errors import actor_death, one_line

        where = f"{self.name} rank {rank} of {len(self.actors)}"
        if isinstance(exc, ray.exceptions.RayActorError):
            return f"{where} died: {actor_death(exc)}"
        return f"{where}: {one_line(exc)}"

    def join(self) -> None:
        """All ranks meet in one process group (a no-op for one rank)."""
        import ray

        if self.joined:
            return
        world = len(self.actors)
        host, port = ray.get(self.leader.data_parallel_rendezvous.remote(world))
        self.wait_all([a.join_data_parallel.remote(host, port, r, world, self.backend) for r, a in enumerate(self.actors)])
        self.joined = True

    def call_each(self, method: str, *args) -> list:
        """``method(*args)`` on every rank; large arguments go into Ray's store once, for all of them."""
        import ray

        self.join()
        if len(self.actors) > 1:
            args = tuple(ray.put(a) if not isinstance(a, (str, int, float)) else a for a in args)
        return self.wait_all([getattr(a, method).remote(*args) for a in self.actors])

    def _check_same_state(self, step_what: str) -> None:
        sums = self.call_each("checksum")
        for r, s in enumerate(sums[1:], start=1):
            if s != sums[0]:
                raise RankFailure(f"{self.name} rank {r} of {len(self.actors)} disagrees with rank 0 {step_what} "
                                  f"(state fingerprint {s} against {sums[0]}): the ranks did not take the same steps")

    def save(self, directory: str, *args) -> None:
        """Rank 0 writes; every rank's trained state is checked against rank 0's first."""
        if len(self.actors) > 1:
            self._check_same_state("at a checkpoint")
        self.wait_all([self.leader.save.remote(directory, *args)])

    def save_reference(self, directory: str) -> None:
        """Rank 0 writes the frozen part (the same on every rank)."""
        self.wait_all([self.leader.save_reference.remote(directory)])

    def load(self, directory: str) -> None:
        self.call_each("load", directory)


class LearnerGroup(RankGroup):
    name = "learner"

    def update(self, samples, advantages, vectors) -> dict:
        return self.call_each("update", samples, advantages, vectors)[0]

    def planned_tokens(self) -> tuple[int | None, int | None]:
        """Every rank plans together (the smallest budget wins); rank 0's answer is theirs."""
        return tuple(self.call_each("planned_tokens")[0])


class CriticGroup(RankGroup):
    name = "critic"

    def score(self, explanations, vectors) -> list:
        if len(self.actors) == 1:
            return self.call_each("score", explanations, vectors)[0]
        scores = [None] * len(explanations)
        for share in self.call_each("score_share", explanations, vectors):
            for i, value in share:
                scores[i] = value
        return scores

    def train_step(self, explanations, vectors) -> dict:
        return self.call_each("train_step", explanations, vectors)[0]
