"""LLM judges behind HTTP: OpenAI-compatible chat completions (a local `vllm serve`, OpenAI) and
Anthropic's Messages API, through httpx.

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
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shared.errors import NlaInputError

DEFAULT_URLS = {"openai": "http://127.0.0.1:18001/v1", "anthropic": "https://api.anthropic.com"}
DEFAULT_CONCURRENCY = {"openai": 8, "anthropic": 1}
ANTHROPIC_VERSION = "2023-06-01"
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


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
    """A judge of ``evals.judge``; ``key`` from the environment variable it names."""

    def __init__(self, cfg, sleep=time.sleep):
        import httpx

        self.cfg = cfg
        self.backend = cfg.backend
        self.base_url = (cfg.base_url or DEFAULT_URLS[cfg.backend]).rstrip("/")
        self.concurrency = cfg.concurrency or DEFAULT_CONCURRENCY[cfg.backend]
        self._key = None
        if cfg.api_key_env is not None:
            self._key = (os.environ.get(cfg.api_key_env) or "").strip()  # a key read from a CRLF .env file ends in \r
            if not self._key:
                raise NlaInputError("evals.judge.api_key_env", f"the environment variable {cfg.api_key_env} is not set "
                                                               "(export the judge's key there)")
            if any(c.isspace() or not c.isprintable() for c in self._key):
                raise NlaInputError("evals.judge.api_key_env", f"the key in {cfg.api_key_env} holds whitespace or control "
                                                               "characters, which no HTTP header can carry")
        self._sleep = sleep
        self._client = httpx.Client(timeout=httpx.Timeout(cfg.timeout_s), headers=self._headers())

    def _headers(self) -> dict:
        if self.backend == "anthropic":
            h = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
            if self._key:
                h["x-api-key"] = self._key
            return h
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    def _masked(self, text: str, limit: int = 300) -> str:
        """``text`` with the key masked out, then cut (never the other way: a cut could split the key)."""
        if self._key:
            for form in (self._key, repr(self._key)[1:-1], repr(self._key.encode())[2:-1]):
                text = text.replace(form, "***")
        return text[:limit]

    # ---- one request ----
    def _request(self, system: str, user: str) -> tuple[str, dict]:
        if self.backend == "anthropic":
            return f"{self.base_url}/v1/messages", {
                "model": self.cfg.model, "max_tokens": self.cfg.max_tokens, "temperature": 0.0, "system": system,
                "messages": [{"role": "user", "content": user}]}
        return f"{self.base_url}/chat/completions", {
            "model": self.cfg.model, "max_tokens": self.cfg.max_tokens, "temperature": 0.0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}

    def _text(self, body: dict) -> str | None:
        try:
            if self.backend == "anthropic":
                return "".join(part.get("text", "") for part in body["content"] if part.get("type") == "text")
            return body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError, AttributeError):
            return None

    def ask(self, system: str, user: str) -> Verdict:
        """One judged prompt, with retries; never raises for what the server or network does."""
        import httpx

        url, payload = self._request(system, user)
        error = "no attempt"
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self._sleep(min(30.0, 0.5 * 2 ** (attempt - 1)))
            try:
                res = self._client.post(url, json=payload)
            except httpx.TimeoutException:
                error = f"timeout after {self.cfg.timeout_s:g} s"
                continue
            except httpx.HTTPError as exc:
                error = self._masked(f"{type(exc).__name__}: {exc}")
                continue
            if res.status_code in RETRY_STATUS:
                error = self._masked(f"HTTP {res.status_code}: {res.text}")
                continue
            if res.status_code != 200:
                return Verdict(None, self._masked(f"HTTP {res.status_code}: {res.text}"))
            try:
                text = self._text(res.json())
            except ValueError:
                return Verdict(None, "the reply is not JSON")
            reply = parse_json_reply(text)
            if reply is None:
                return Verdict(None, "no JSON object in the judge's reply", raw=text)
            return Verdict(reply, raw=text)
        return Verdict(None, f"{error} ({self.cfg.retries + 1} attempts)")

    def ask_many(self, prompts: list[tuple[str, str]]) -> list[Verdict]:
        """``(system, user)`` prompts judged ``concurrency`` at a time, verdicts in prompt order."""
        if not prompts:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)))
        try:
            return list(pool.map(lambda p: self.ask(*p), prompts))
        finally:  # Ctrl-C or SIGTERM: the queued requests are dropped, not waited for
            pool.shutdown(wait=False, cancel_futures=True)

    def check(self) -> None:
        """Before training starts: the server answers (one line naming it and the cause otherwise)."""
        import httpx

        url = f"{self.base_url}/v1/models" if self.backend == "anthropic" else f"{self.base_url}/models"
        try:
            res = self._client.get(url)
        except httpx.HTTPError as exc:
            raise NlaInputError("evals.judge", f"{self.backend} judge at {self.base_url} does not answer "
                                               f"({self._masked(f'{type(exc).__name__}: {exc}')})") from None
        if res.status_code in (401, 403):
            raise NlaInputError("evals.judge", f"{self.backend} judge at {self.base_url} refuses the key "
                                               f"(HTTP {res.status_code}; key from {self.cfg.api_key_env})")
        if res.status_code >= 500:
            raise NlaInputError("evals.judge", f"{self.backend} judge at {self.base_url} fails (HTTP {res.status_code})")

    def close(self) -> None:
        self._client.close()
