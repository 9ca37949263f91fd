"""LLM judges behind HTTP: OpenAI-compatible chat completions (a local `vllm serve`, OpenAI) and
Anthropic's Messages API, through ``evals.chat_client.ChatClient`` (shared with the teacher of
``data explain``).

One interface, ``Judge.ask_many(prompts) -> [Verdict]``: temperature 0, bounded concurrency, a timeout
per request, retries with exponential backoff on timeouts, connection errors, 429 and 5xx. A reply is
asked for as one JSON object; ``parse_json_reply`` takes it tolerantly (code fences, prose around it).
Any failure (HTTP error after the retries, an empty or unparseable reply) is a ``Verdict`` with
``error`` set: the evals count it as a judge failure, never as a pass. The key is read from the
environment variable the config names, sent only in the request header, and never logged or written:
errors carry the status and the server's message with the key masked out.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from nla_grpo.evals.chat_client import ANTHROPIC_VERSION, DEFAULT_CONCURRENCY, DEFAULT_URLS, RETRY_STATUS, ChatClient  # noqa: F401


@dataclass
class Verdict:
    """One judge reply: the parsed JSON object, or why there is none."""

    reply: dict | None
    error: str | None = None
    raw: str | None = None


def parse_json_reply(text: str | None) -> dict | None:
    """The first JSON object in ``text`` (bare, in a ``` fence, or inside prose), or None."""
    if not text:
        return None
    text = text.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    candidates = [fenced.group(1)] if fenced else []
    candidates.append(text)
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = candidate.find("{")
        while start >= 0:  # the first balanced object that parses
            try:
                obj, _ = json.JSONDecoder().raw_decode(candidate[start:])
                if isinstance(obj, dict):
                    return obj
            except json.JSONDecodeError:
                pass
            start = candidate.find("{", start + 1)
    return None


class Judge:
    """A judge of ``evals.judge``; ``key`` from the environment variable it names. The HTTP side is a
    ``ChatClient``; this layer asks at temperature 0 and reads the reply as one JSON object."""

    def __init__(self, cfg, sleep=time.sleep):
        self.cfg = cfg
        self._chat = ChatClient(cfg.backend, cfg.base_url, cfg.model, api_key_env=cfg.api_key_env,
                                concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, retries=cfg.retries,
                                max_tokens=cfg.max_tokens, temperature=0.0, where="evals.judge", role="judge", sleep=sleep)
        self.backend, self.base_url, self.concurrency = self._chat.backend, self._chat.base_url, self._chat.concurrency
        self._key = self._chat._key

    @staticmethod
    def _verdict(reply) -> Verdict:
        if reply.error is not None:
            return Verdict(None, reply.error)
        parsed = parse_json_reply(reply.text)
        if parsed is None:
            return Verdict(None, "no JSON object in the judge's reply", raw=reply.text)
        return Verdict(parsed, raw=reply.text)

    def ask(self, system: str, user: str) -> Verdict:
        """One judged prompt, with retries; never raises for what the server or network does."""
        return self._verdict(self._chat.chat(system, user))

    def ask_many(self, prompts: list[tuple[str, str]]) -> list[Verdict]:
        """``(system, user)`` prompts judged ``concurrency`` at a time, verdicts in prompt order."""
        return [self._verdict(r) for r in self._chat.chat_many(prompts)] if prompts else []

    def check(self) -> None:
        """Before training starts: the server answers (one line naming it and the cause otherwise)."""
        self._chat.check()

    def close(self) -> None:
        self._chat.close()
