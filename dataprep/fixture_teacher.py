"""The tiny fixture's teacher: a rule, not a model, served on loopback as an OpenAI-compatible chat API.

Its explanation of a row is the marked token itself (``⟦salt⟧`` → ``<explanation>salt</explanation>``): on
the tiny fixture an activation read after block 0 is mostly its token's embedding, so naming the token is
what a verbaliser can learn from it and a reconstructor can read back. It stands in for a teacher LLM so
that ``nla-grpo data explain --teacher fixture`` and the tiny pipeline run on a machine with nothing of the
user's own; it says nothing true of a real model's activations, so it is never a default for real data.

It runs as a real HTTP server on 127.0.0.1 (a free port, a thread of the calling process), so the
explanations reach ``data explain`` through the same client, journal and checks as a real teacher's.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_NAME = "tiny-fixture-rule"
"""What the explained splits' sidecars record as the teacher model."""

_MARKED = re.compile(r"(\S*?)\s*⟦([^⟧]*)⟧\s*$")


def marked(user: str) -> tuple[str, str]:
    """``(token, word before it)`` of a ``data explain`` prompt: the text marked ``⟦…⟧`` at the end of its
    ``<document>`` block and the non-blank run before the mark (each ``""`` where there is none)."""
    doc = user.split("<document>\n", 1)[-1].rsplit("\n</document>", 1)[0]
    m = _MARKED.search(doc)
    return (m.group(2), m.group(1)) if m else ("", "")


_BLANKS = {" ": "space", "\n": "newline", "\t": "tab", "\r": "return"}


def fixture_explanation(token: str) -> str:
    """The rule: the token's text, stripped; a token of whitespace alone is named by its characters
    (``" "`` → ``space``, ``"\n\n"`` → ``newline newline``), so that every token has a name to learn."""
    text = token.strip()
    if text or not token:
        return text
    return " ".join(_BLANKS.get(c, "blank") for c in token)


def fixture_reply(user: str) -> str:
    """The rule's reply to a ``data explain`` prompt, in the explanation tags (a prompt whose mark is empty,
    the token not at the end of its text, gets an empty explanation: ``data explain`` drops and counts it)."""
    return f"<explanation>{fixture_explanation(marked(user)[0])}</explanation>"


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet request handler that answers JSON (``_send``); loopback chat servers subclass it."""

    def log_message(self, *args):
        pass

    def _send(self, status: int, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LoopbackServer(ThreadingHTTPServer):
    """A threaded server on 127.0.0.1 (a free port) whose request threads never hold the process."""

    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)

    def handle_error(self, request, client_address):
        pass  # a client that went away mid-request: nothing to report


class FixtureTeacher:
    """``with FixtureTeacher() as t: ... t.url ...``: the rule behind ``/v1/chat/completions`` and ``/v1/models``."""

    def __init__(self):
        class Handler(JsonHandler):
            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    return self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
                self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                    user = body["messages"][-1]["content"]
                except (ValueError, KeyError, IndexError, TypeError):
                    return self._send(400, {"error": {"message": "expected a chat-completions request"}})
                text = fixture_reply(user)
                usage = {"prompt_tokens": len(user.split()), "completion_tokens": len(text.split()),
                         "total_tokens": len(user.split()) + len(text.split())}
                self._send(200, {"object": "chat.completion", "model": MODEL_NAME, "usage": usage,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}]})

        self.httpd = LoopbackServer(Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fixture-teacher", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "FixtureTeacher":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.httpd.shutdown()
        self.httpd.server_close()
        return False
