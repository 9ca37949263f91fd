"""Judged faithfulness evals: the judges (``judges``: OpenAI-compatible and Anthropic over HTTP)."""
