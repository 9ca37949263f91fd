"""Reaching into a built ``LLM``: where its engine core runs (``engine_in_process``, ``in_process_engine_core``,
``in_process_scheduler``), which model runner and scheduling it chose, its shutdown, its eager adapter load and
removal (public on ``LLMEngine``, not on ``LLM``), and ``worker_model``, the ``nn.Module`` a worker runs.
"""
from __future__ import annotations


def _engine_core(llm):
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def engine_in_process(llm) -> bool:
    """True when the engine core (and so the worker) runs in this process."""
    return type(_engine_core(llm)).__name__ == "InprocClient"


def in_process_engine_core(llm):
    """The v1 ``EngineCore`` of an in-process engine (the rollout profile times its parts), or None."""
    return getattr(_engine_core(llm), "engine_core", None) if engine_in_process(llm) else None


def in_process_scheduler(llm):
    """The v1 scheduler of an in-process engine core (tests count its preemptions), or None."""
    return getattr(in_process_engine_core(llm), "scheduler", None)


def model_runner(llm) -> str:
    """Which of vLLM's GPU model runners the engine chose: "v2" or "v1" (vLLM 0.26 picks V2 for dense models
    unless prompt embeddings are enabled; a vLLM without the choice runs "v1")."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return "v2" if getattr(config, "use_v2_model_runner", False) else "v1"


def async_scheduling(llm) -> bool:
    """Whether the engine schedules step n+1 while step n runs on the device (vLLM 0.26 turns it on by default where
    the executor supports it, the one-process executor included)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


def shutdown_engine_core(llm) -> None:
    """Stop the engine core's processes now (dropping the ``LLM`` leaves them to the garbage collector)."""
    core = _engine_core(llm)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def engine_add_lora(llm, request) -> bool:
    """Load an adapter eagerly, so load errors and cost land in the push, not in the next generate."""
    return bool(llm.llm_engine.add_lora(request))


def engine_remove_lora(llm, lora_int_id: int) -> bool:
    """Drop an adapter from the engine's workers (public on LLMEngine, not on LLM)."""
    return bool(llm.llm_engine.remove_lora(lora_int_id))


def worker_model(worker):
    """Inside a worker (``collective_rpc``): the model ``nn.Module`` its runner executes."""
    inner = getattr(worker, "worker", None) or worker
    runner = inner.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model
