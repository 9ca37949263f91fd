"""The last hop of a push: how a received adapter is registered with a vLLM engine (the hops before
it, learner to engine actor, are ``shared.weight_sync``). Two ways:

- in memory (every ``weight_sync`` kind but ``file``): the tensors go through ``LLM.collective_rpc``
  and are registered inside the worker (``rollout.vllm.worker_lora``; ms instead of seconds at scale);
- ``file``: a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``) in a
  node-local directory, loaded by vLLM's public ``add_lora`` (public API only; the fallback).

Either way every version gets a new adapter name and id (reusing an id with new weights silently
keeps the old ones), and at most ``keep`` versions stay registered; older ones are removed.
"""
from __future__ import annotations

import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from nla_grpo.rollout.vllm.handles import engine_in_process
from nla_grpo.shared.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from nla_grpo.shared.fileio import jsonable, write_json
from nla_grpo.shared.types import AdapterUpdate



def adapter_name(version: int) -> str:
    return f"policy-v{version}"


def contiguous_tensors(tensors: dict, device=None) -> dict:
    """Contiguous tensors on ``device`` (default: where they are), as safetensors and vLLM need them."""
    return {k: t.detach().to(device if device is not None else t.device).contiguous() for k, t in tensors.items()}


def check_version(version: int, current_version: int) -> None:
    if version <= 0:
        raise ValueError(f"adapter version must be >= 1 (0 is the bare model), found {version}")
    if version <= current_version:
        raise ValueError(f"adapter version {version} is not newer than the loaded version {current_version}")


@dataclass
class ForwardedUpdate:
    """A push whose tensors the vLLM worker fetches itself: a ``cuda_ipc`` message handed on to an engine
    core in its own process (the worker opens the learner's buffer; nothing is serialised but the handle)."""

    version: int
    message: object  # shared.weight_sync.AdapterMessage

    @property
    def peft_config(self) -> dict:
        return self.message.peft_config


def check_update(update: AdapterUpdate, current_version: int) -> None:
    check_version(update.version, current_version)
    if not update.tensors:
        raise ValueError(f"adapter version {update.version} has no tensors")


def write_adapter_dir(update: AdapterUpdate, directory: Path) -> Path:
    """A PEFT adapter directory vLLM and PEFT can both load."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(contiguous_tensors(update.tensors, "cpu"), str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    write_json(directory / ADAPTER_CONFIG, update.peft_config)
    return directory


def node_local_tmp() -> str | None:
    """RAM-backed /dev/shm where present (the push is a memory copy), else the default temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


class AdapterRegistry(ABC):
    """Registers adapter versions with a vLLM ``LLM`` and hands back the ``LoRARequest`` to generate with."""

    def __init__(self, llm, keep: int, directory: str | None = None):
        self.llm = llm
        self.keep = max(1, int(keep))
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="nla-adapters-", dir=directory or node_local_tmp()))
        self._live: list[int] = []  # registered versions, oldest first

    def push(self, update: AdapterUpdate):
        """Register ``update`` under a new name/id; returns its ``LoRARequest``; retires old versions."""
        request = self._register(update)
        self._live.append(update.version)
        while len(self._live) > self.keep:
            self._retire(self._live.pop(0))
        return request

    @abstractmethod
    def _register(self, update: AdapterUpdate): ...

    def _retire(self, version: int) -> None:
        from nla_grpo.rollout.vllm.handles import engine_remove_lora

        engine_remove_lora(self.llm, version)
        shutil.rmtree(self.root / adapter_name(version), ignore_errors=True)

    @property
    def live_versions(self) -> list[int]:
        return list(self._live)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class FileRegistry(AdapterRegistry):
    """Adapter directory in a node-local temp dir, loaded eagerly through the engine's public add_lora."""

    def _register(self, update: AdapterUpdate):
        from vllm.lora.request import LoRARequest

        from nla_grpo.rollout.vllm.handles import engine_add_lora

        path = write_adapter_dir(update, self.root / adapter_name(update.version))
        request = LoRARequest(adapter_name(update.version), update.version, str(path))
        engine_add_lora(self.llm, request)
        return request


class MemoryRegistry(AdapterRegistry):
    """Tensors handed to each vLLM worker through ``collective_rpc`` and built into a LoRAModel there.

    With an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the CPU default, and the
    colocated benchmark) the call reaches the worker directly, so the tensors go as they are, on
    whatever device the learner left them (no copies through the host). A separate engine-core
    process gets safetensors bytes: a dict of tensors does not survive its msgpack route.
    """

    def __init__(self, llm, keep: int, direct: bool | None = None):
        super().__init__(llm, keep)
        self.direct = engine_in_process(llm) if direct is None else direct

    def _register(self, update: AdapterUpdate):
        from safetensors.torch import save
        from vllm.lora.request import LoRARequest

        from nla_grpo.rollout.vllm.worker_lora import register_adapter_in_worker

        # the request needs a path, never read (the id is already registered); an empty dir keeps
        # any path validation on the way happy
        path = self.root / adapter_name(update.version)
        path.mkdir(parents=True, exist_ok=True)
        # direct: tensors stay where they are (GPU tensors go straight into the worker's LoRA slots); a
        # forwarded message goes pickled (the worker opens it)
        if isinstance(update, ForwardedUpdate):
            from nla_grpo.rollout.vllm.worker_lora import forwarded_message

            payload = forwarded_message(update.message)
        else:
            payload = contiguous_tensors(update.tensors) if self.direct else save(contiguous_tensors(update.tensors, "cpu"))
        config = jsonable(update.peft_config)
        # per worker: where the push time went (unpack / build / add), for benchmarks and logs
        self.last_timings = self.llm.collective_rpc(
            register_adapter_in_worker, args=(update.version, adapter_name(update.version), str(path), payload, config)
        )
        return LoRARequest(adapter_name(update.version), update.version, str(path))


def make_registry(weight_sync, llm, keep: int) -> AdapterRegistry:
    """File registration for ``weight_sync.kind: file`` (in its ``directory``), in memory otherwise."""
    if weight_sync.registers_from_directory:
        return FileRegistry(llm, keep, directory=weight_sync.directory)
    return MemoryRegistry(llm, keep)
