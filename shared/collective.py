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


def channel_address() -> tuple[str, int]:
    """This node's address and a free TCP port on it, for rank 0 to listen on."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class AdapterChannel:
    """One member of the channel; every member calls ``broadcast`` for each transfer."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 600.0):
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"adapter channel backend: expected one of {BACKENDS}, found {backend!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        store = dist.PrefixStore("nla-adapter", store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def broadcast(self, buf) -> None:
        """Rank 0's ``buf`` into every other member's ``buf`` (same size and dtype), in place."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buf], opts).wait()
        if buf.is_cuda:
            import torch

            torch.cuda.current_stream(buf.device).synchronize()
