"""A scripted judge on loopback that speaks OpenAI's chat-completions and Anthropic's Messages API (a
real HTTP server in a thread, so the clients are exercised end to end). The user message picks the
behaviour: a reply of its own (``REPLY:<text>``), ``FAIL500`` (always 500, echoing the request's
headers), ``FLAKY`` (500 once per distinct prompt, then the reply), ``RATE`` (429 once), ``SLOW``
(answers after ``slow_s``); anything else gets ``{"ok": true}``."""
from __future__ import annotations

import json
import threading
import time

from nla_grpo.dataprep.fixture_teacher import JsonHandler, LoopbackServer


class JudgeServer:
    def __init__(self, slow_s: float = 1.0, models_status: int = 200, reply_fn=None):
        """``reply_fn(user message) -> reply text``: the answer to anything not scripted above."""
        self.slow_s, self.models_status, self.reply_fn = slow_s, models_status, reply_fn
        self.requests: list[dict] = []
        self.seen: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path.endswith("/models"):
                    self._send(server.models_status, {"data": [{"id": "judge"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                anthropic = self.path.endswith("/v1/messages")
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, payload = self._answer(body, anthropic)
                finally:
                    # before the reply leaves: a client that got it may send its next request at once, and
                    # that one must not find this one still counted
                    with server.lock:
                        server.in_flight -= 1
                self._send(status, payload)

            def _answer(self, body, anthropic: bool):
                user = body["messages"][-1]["content"]
                with server.lock:
                    server.seen[user] = server.seen.get(user, 0) + 1
                    first = server.seen[user] == 1
                if "FAIL500" in user:
                    # the key first, as a careless server's error page might show it
                    return 500, {"error": f"boom; auth was {self.headers.get('Authorization') or self.headers.get('x-api-key')}; {dict(self.headers)}"}
                if ("FLAKY" in user and first):
                    return 503, {"error": "try again"}
                if "RATE" in user and first:
                    return 429, {"error": "slow down"}
                if "SLOW" in user:
                    time.sleep(server.slow_s)
                if "REPLY:" in user:
                    text = user.split("REPLY:", 1)[1]
                else:
                    text = server.reply_fn(user) if server.reply_fn else '{"ok": true}'
                if anthropic:
                    return 200, {"content": [{"type": "text", "text": text}], "role": "assistant"}
                return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}

        self.httpd = LoopbackServer(Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        return False
