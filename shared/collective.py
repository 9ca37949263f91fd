"""A private broadcast channel for the adapter: the learner (rank 0) sends one packed buffer to every
rollout engine (ranks 1..n) in a single collective.

The process group is built directly on a TCPStore, never as torch.distributed's default group: in the
rollout process vLLM's worker owns that one. NCCL between GPUs (split placement: the buffer goes
GPU to GPU, no host copy), gloo between CPU processes (the tests). NCCL cannot join two ranks on one
GPU, so colocated placement uses a CUDA IPC handle instead (``shared.tensor_wire``).
"""
from __future__ import annotations

import datetime

BACKENDS = ("nccl", "gloo")


class AdapterChannel:
    """One member of the channel; every member calls ``broadcast`` for each transfer.

    Rank 0 first calls ``serve`` (a store on a free port of its node; returns where it listens), then
    every member, rank 0 included, calls ``join`` at the same time (the group's rendezvous).
    """

    def __init__(self, timeout_s: float = 600.0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = None
        self.group = None

    def serve(self, world_size: int) -> tuple[str, int]:
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        # port 0: the OS picks a free port while the store binds it (no window for another process)
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False)
        return host, self.store.port

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"adapter channel backend: expected one of {BACKENDS}, found {backend!r}")
        if rank == 0:
            if self.store is None:
                raise RuntimeError("adapter channel: rank 0 must serve() before join()")
            store = self.store
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore("nla-adapter", store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout  # a member that died must not hold the others for NCCL's default
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def broadcast(self, buf) -> None:
        """Rank 0's ``buf`` into every other member's ``buf`` (same size and dtype), in place."""
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("adapter channel: join() first")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buf], opts).wait()
        if buf.is_cuda:
            import torch

            torch.cuda.current_stream(buf.device).synchronize()
