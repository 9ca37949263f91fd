"""One HTTP chat client for everything that asks an LLM behind an API: the judges of the evals and the
teacher of ``data explain``. OpenAI-compatible chat completions (a local ``vllm serve``, OpenAI) and
Anthropic's Messages API, through httpx.

Why one client: the two callers need the same care and nothing else differs. A request has a timeout
and is retried with exponential backoff on timeouts, connection errors, 408/409/429 and 5xx; any other
status is final and comes back with its code, so a caller can stop at once on a refused key (401/403)
or a wrong URL or model (404). Nothing the server or the network does raises: a ``ChatReply`` carries
the text, or why there is none, and the token usage either API reports. At most ``concurrency``
requests are in flight (a pool of threads). The key is read from the environment variable named, sent only
in the request header, and masked out of every error text, since a careless server may echo it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from nla_grpo.shared.errors import NlaInputError

BACKENDS = ("openai", "anthropic")
DEFAULT_URLS = {"openai": "http://127.0.0.1:18001/v1", "anthropic": "https://api.anthropic.com"}
DEFAULT_CONCURRENCY = {"openai": 8, "anthropic": 1}
ANTHROPIC_VERSION = "2023-06-01"
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


@dataclass
class ChatReply:
    """One answer: ``text`` (None when the server gave none), or ``error`` (masked) and, for an HTTP
    failure, its ``status``; the tokens the server counted; the HTTP attempts it took."""

    text: str | None
    error: str | None = None
    status: int | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    attempts: int = 1


def read_key(api_key_env: str | None, where: str, role: str) -> str | None:
    """The key in ``api_key_env`` (stripped: one read from a CRLF .env file ends in \\r), or one line."""
    if api_key_env is None:
        return None
    key = (os.environ.get(api_key_env) or "").strip()
    if not key:
        raise NlaInputError(where, f"the environment variable {api_key_env} is not set (export the {role}'s key there)")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise NlaInputError(where, f"the key in {api_key_env} holds whitespace or control characters, which no HTTP "
                                   "header can carry")
    return key


class ChatClient:
    """Chat requests to one model at ``base_url``. ``where`` names the setting in error lines
    (``evals.judge``, ``--base-url``), ``key_where`` the key's setting, ``role`` what the server is to
    the user (``judge``, ``teacher``)."""

    def __init__(self, backend: str, base_url: str | None, model: str, *, api_key_env: str | None = None,
                 concurrency: int | None = None, timeout_s: float = 60.0, retries: int = 3, max_tokens: int = 512,
                 temperature: float = 0.0, where: str = "--base-url", key_where: str | None = None,
                 role: str = "server", sleep=time.sleep):
        import httpx

        if backend not in BACKENDS:
            raise NlaInputError(where, f"expected an API of {', '.join(BACKENDS)}, found {backend!r}")
        self.backend, self.model, self.role, self.where = backend, model, role, where
        self.base_url = (base_url or DEFAULT_URLS[backend]).rstrip("/")
        self.concurrency = concurrency or DEFAULT_CONCURRENCY[backend]
        self.timeout_s, self.retries, self.max_tokens, self.temperature = timeout_s, retries, max_tokens, temperature
        self.api_key_env = api_key_env
        self._key = read_key(api_key_env, key_where or f"{where}.api_key_env", role)
        self._sleep = sleep
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=self._headers())

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/messages" if self.backend == "anthropic" else f"{self.base_url}/chat/completions"

    @property
    def models_url(self) -> str:
        return f"{self.base_url}/v1/models" if self.backend == "anthropic" else f"{self.base_url}/models"

    def _headers(self) -> dict:
        if self.backend == "anthropic":
            h = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
            if self._key:
                h["x-api-key"] = self._key
            return h
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    def masked(self, text: str, limit: int = 300) -> str:
        """``text`` with the key masked out, then cut (never the other way: a cut could split the key)."""
        if self._key:
            for form in (self._key, repr(self._key)[1:-1], repr(self._key.encode())[2:-1]):
                text = text.replace(form, "***")
        return text[:limit]

    def _payload(self, system: str, user: str, temperature: float) -> dict:
        if self.backend == "anthropic":
            return {"model": self.model, "max_tokens": self.max_tokens, "temperature": temperature, "system": system,
                    "messages": [{"role": "user", "content": user}]}
        return {"model": self.model, "max_tokens": self.max_tokens, "temperature": temperature,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}

    def _parse(self, body) -> tuple[str | None, int, int]:
        """The reply's text (None when the body has none) and its usage (0 where the server counts none)."""
        text = None
        try:
            if self.backend == "anthropic":
                text = "".join(part.get("text", "") for part in body["content"] if part.get("type") == "text")
            else:
                text = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError, AttributeError):
            pass
        usage = body.get("usage") if isinstance(body, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        names = ("input_tokens", "output_tokens") if self.backend == "anthropic" else ("prompt_tokens", "completion_tokens")

        def count(name):
            v = usage.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        return (text if isinstance(text, str) else None), count(names[0]), count(names[1])

    def chat(self, system: str, user: str, temperature: float | None = None) -> ChatReply:
        """One prompt, with retries; never raises for what the server or network does."""
        import httpx

        payload = self._payload(system, user, self.temperature if temperature is None else temperature)
        error, status = "no attempt", None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(min(30.0, 0.5 * 2 ** (attempt - 1)))
            try:
                res = self._client.post(self.chat_url, json=payload)
            except httpx.TimeoutException:
                error, status = f"timeout after {self.timeout_s:g} s", None
                continue
            except httpx.HTTPError as exc:
                error, status = self.masked(f"{type(exc).__name__}: {exc}"), None
                continue
            if res.status_code in RETRY_STATUS:
                error, status = self.masked(f"HTTP {res.status_code}: {res.text}"), res.status_code
                continue
            if res.status_code != 200:
                return ChatReply(None, self.masked(f"HTTP {res.status_code}: {res.text}"), res.status_code, attempts=attempt + 1)
            try:
                body = res.json()
            except ValueError:
                return ChatReply(None, "the reply is not JSON", attempts=attempt + 1)
            text, tokens_in, tokens_out = self._parse(body)
            return ChatReply(text, None, None, tokens_in, tokens_out, attempt + 1)
        return ChatReply(None, f"{error} ({self.retries + 1} attempts)", status, attempts=self.retries + 1)

    def chat_many(self, prompts: list[tuple[str, str]], temperature: float | None = None) -> list[ChatReply]:
        """``(system, user)`` prompts asked ``concurrency`` at a time, replies in prompt order."""
        return [r for _, r in sorted(self.imap_unordered(lambda p: self.chat(*p, temperature=temperature),
                                                         list(enumerate(prompts)), key=True), key=lambda kr: kr[0])]

    def imap_unordered(self, fn, items, key: bool = False):
        """``(item, fn(item))`` as each finishes, at most ``concurrency`` running. Items are taken from the
        iterable only as a slot frees up, so stopping early (an exception, ``close()``) leaves only the
        requests in flight; their threads are daemons, never waited for (a hung server cannot hold the
        process). ``key``: items are ``(k, x)``, ``fn`` gets ``x`` and ``k`` is yielded."""
        import queue
        import threading

        items = iter(items)
        todo, results = queue.Queue(), queue.Queue()

        def worker():
            while True:
                job = todo.get()
                if job is _END:
                    return
                k, x = job
                try:
                    results.put((k, True, fn(x)))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    results.put((k, False, exc))

        threads = [threading.Thread(target=worker, daemon=True, name=f"chat-{i}") for i in range(max(1, self.concurrency))]
        for t in threads:
            t.start()
        running = 0
        try:
            while True:
                while running < len(threads):
                    item = next(items, _END)
                    if item is _END:
                        break
                    todo.put(item if key else (item, item))
                    running += 1
                if not running:
                    return
                k, ok, value = results.get()
                running -= 1
                if not ok:
                    raise value
                yield k, value
        finally:  # Ctrl-C, SIGTERM, an abort: nothing more is asked
            for _ in threads:
                todo.put(_END)

    def check(self) -> None:
        """Before anything is asked: the server answers (one line naming it and the cause otherwise)."""
        import httpx

        try:
            res = self._client.get(self.models_url)
        except httpx.HTTPError as exc:
            raise NlaInputError(self.where, f"{self.backend} {self.role} at {self.base_url} does not answer "
                                            f"({self.masked(f'{type(exc).__name__}: {exc}')})") from None
        if res.status_code in (401, 403):
            raise NlaInputError(self.where, f"{self.backend} {self.role} at {self.base_url} refuses the key "
                                            f"(HTTP {res.status_code}; key from {self.api_key_env})")
        if res.status_code >= 500:
            raise NlaInputError(self.where, f"{self.backend} {self.role} at {self.base_url} fails (HTTP {res.status_code})")

    def close(self) -> None:
        self._client.close()


_END = object()
