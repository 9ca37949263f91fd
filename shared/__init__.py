"""What every service and command shares, and nothing above it: the config schema, the NLA spec and data
reader, prompts and injection, the reward and FVE maths, the weight-sync variants and their byte layout,
process groups, file I/O and checkpoint helpers, model and quantisation checks, the error types, the Ray
cluster start.

Nothing here imports ``rollout``, ``critic``, ``learner``, ``orchestrator``, ``sft``, ``evals`` or ``dataprep``.
"""
