"""The controller: the ``nla-grpo`` command, the checks a run makes before any actor starts, Ray placement,
the driver loop and its step metrics, the run directory, plots, the pipeline of the four stages and the
import of a reference-trainer run.

``cli`` parses the commands, ``job`` checks a run, ``placement`` starts the services, ``driver`` runs the
loop (``rollout_feed``, ``weight_push`` and ``groups`` are its halves of the services), ``run_dir``,
``metrics`` and ``plot`` keep what it writes, ``pipeline`` and ``import_run`` are commands of their own.
"""
