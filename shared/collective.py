"""Process groups between Ray actors, set up from addresses Ray gives (so they span nodes), every
collective torch.distributed's own:

- ``AdapterChannel``: a private broadcast group for the adapter, the learner (rank 0) sending one
  packed buffer to every rollout engine (ranks 1..n). Built directly on a TCPStore, never as
  torch.distributed's default group: in the rollout process vLLM's worker owns that one. NCCL between
  GPUs (split placement: GPU to GPU, no host copy), gloo between CPU processes. NCCL cannot join two
  ranks on one GPU, so colocated placement uses a CUDA IPC handle instead (``shared.weight_sync``).
- ``DataParallel``: the learner's (or the critic's) ranks, one process each, as that process's
  default group: sums of gradients (bucketed) and of the few numbers a step reports, the smallest
  of a number (a memory budget every rank can hold), every rank's fingerprint.

Either way rank 0 first calls ``serve`` (a store on a free port of its node; returns where it
listens), then every member, rank 0 included, joins at the same time (the group's rendezvous).
"""
from __future__ import annotations

import datetime
import socket

BACKENDS = ("nccl", "gloo")


def deal_micro_batches(tokens: list[int], world_size: int) -> list[list[int]]:
    """Micro-batch indices per data-parallel rank: largest first, each to the rank with the fewest tokens
    so far (ties: the lowest rank); every rank's list in plan order. Every rank computes the same deal."""
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for j in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(j)
        load[r] += tokens[j]
    return [sorted(x) for x in out]


class GradientSums:
    """Micro-batch gradients summed in float64, so the sum does not depend on how the micro-batches are
    split over data-parallel ranks (or in what order they ran); a single micro-batch stays as it is."""

    def __init__(self, params, several: bool):
        import torch

        self.params = list(params)
        self.acc = [torch.zeros_like(p, dtype=torch.float64) for p in self.params] if several else None

    def add(self) -> None:
        """After a backward: move the gradients into the sums."""
        if self.acc is None:
            return
        for a, p in zip(self.acc, self.params):
            if p.grad is not None:
                a.add_(p.grad)
                p.grad = None

    def finish(self, dp: "DataParallel") -> None:
        """Sums over every rank, back into ``.grad`` in the parameters' dtype."""
        if self.acc is None:
            return
        dp.sum_tensors(self.acc)
        for a, p in zip(self.acc, self.params):
            p.grad = a.to(p.dtype)
        self.acc = None


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"process group backend: expected one of {BACKENDS}, found {backend!r}")


class _Rendezvous:
    """Rank 0's TCPStore and the members' clients of it."""

    def __init__(self, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = None

    def serve(self, world_size: int) -> tuple[str, int]:
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        # bound here, on the node's address only (the store alone would listen on every interface;
        # a private local cluster's address is loopback); port 0: the OS picks a free one while binding
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(world_size * 4)
        port = sock.getsockname()[1]
        self.store = dist.TCPStore(host, port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False,
                                   master_listen_fd=sock.detach(), use_libuv=True)  # the store owns the socket now
        return host, port

    def store_for(self, host: str, port: int, rank: int, world_size: int, prefix: str):
        import torch.distributed as dist

        if rank == 0:
            if self.store is None:
                raise RuntimeError("process group: rank 0 must serve() before joining")
            store = self.store
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=self.timeout)
        return dist.PrefixStore(prefix, store)


class AdapterChannel(_Rendezvous):
    """One member of the adapter channel; every member calls ``broadcast`` for each transfer."""

    def __init__(self, timeout_s: float = 600.0):
        super().__init__(timeout_s)
        self.group = None

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        import torch.distributed as dist

        _check_backend(backend)
        store = self.store_for(host, port, rank, world_size, "nla-adapter")
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


class DataParallel(_Rendezvous):
    """This process's place among N data-parallel ranks (rank 0 of 1 until ``join``)."""

    BUCKET_BYTES = 64 << 20  # gradients travel in buckets of about this size

    def __init__(self, timeout_s: float = 600.0):
        super().__init__(timeout_s)
        self.rank, self.world_size = 0, 1

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        import torch.distributed as dist

        _check_backend(backend)
        store = self.store_for(host, port, rank, world_size, "nla-dp")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        self.rank, self.world_size = rank, world_size

    def sum_values(self, values: list[float], device) -> list[float]:
        """Element-wise sums over every rank (float64); the values themselves with one rank."""
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def share(self, tokens: list[int]) -> list[int]:
        """This rank's micro-batches of a plan whose micro-batches hold ``tokens`` (all of them alone)."""
        if self.world_size == 1:
            return list(range(len(tokens)))
        return deal_micro_batches(tokens, self.world_size)[self.rank]

    def min_value(self, value: float, device) -> float:
        """The smallest ``value`` over every rank."""
        if self.world_size == 1:
            return float(value)
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t.item())

    def sum_tensors(self, tensors: list) -> None:
        """Every tensor replaced, in place, by its sum over ranks; in buckets of one dtype each."""
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        bucket, size = [], 0
        for i, t in enumerate(tensors):
            bucket.append(t)
            size += t.numel() * t.element_size()
            nxt = tensors[i + 1] if i + 1 < len(tensors) else None
            if nxt is None or size >= self.BUCKET_BYTES or nxt.dtype != t.dtype:
                flat = torch.cat([q.reshape(-1) for q in bucket])
                dist.all_reduce(flat)
                offset = 0
                for q in bucket:
                    q.copy_(flat[offset: offset + q.numel()].view_as(q))
                    offset += q.numel()
                bucket, size = [], 0
