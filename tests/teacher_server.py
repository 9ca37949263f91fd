"""A scripted teacher on loopback speaking OpenAI's chat completions (a real HTTP server in a thread, so
``data explain`` and its client are exercised end to end). Its answer is a function of the prompt
alone: the token marked ``⟦x⟧`` at the end of the ``<document>`` block and the word before it give
``<explanation>x after y</explanation>``, with usage counts derived from the prompt's length.

Behaviours, switchable while it runs: ``refuse`` (every answer a refusal), ``status`` (every request,
``/models`` included, answers that HTTP status), ``chat_status`` (only the chat requests do),
``empty_first`` (the first ask of each prompt gets an empty reply), ``reply_fn(user)`` (its text, when
not None, is the reply), ``block_after`` (after that many
answers every request hangs until the server stops, then gets no reply: a kill test's stall).
``answered[prompt]`` counts the explanations it sent per prompt, ``seen[prompt]`` the requests."""
from __future__ import annotations

import json
import threading

from nla_grpo.dataprep.fixture_teacher import JsonHandler, LoopbackServer, marked


def expected_answer(user: str) -> str:
    """The explanation the server gives for a user prompt (what a test expects to find in the output)."""
    token, before = marked(user)
    return f"{token or 'END'} after {before or 'START'}"


class TeacherServer:
    def __init__(self, refuse: bool = False, status: int | None = None, chat_status: int | None = None,
                 empty_first: bool = False, block_after: int | None = None, reply_fn=None, token_only: bool = False):
        self.refuse, self.status, self.chat_status, self.reply_fn = refuse, status, chat_status, reply_fn
        self.empty_first, self.block_after = empty_first, block_after
        self.token_only = token_only  # answer the marked token alone (what a tiny verbaliser can learn to name)
        self.seen: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.temperatures: list[float] = []
        self.blocked = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        server = self

        class Handler(JsonHandler):
            def do_GET(self):
                if server.status:
                    return self._send(server.status, {"error": "no"})
                self._send(200 if self.path.endswith("/models") else 404, {"data": [{"id": "teacher"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if server.status or server.chat_status:
                    return self._send(server.status or server.chat_status, {"error": {"message": "invalid api key"}})
                user = body["messages"][-1]["content"]
                with server.lock:
                    server.seen[user] = server.seen.get(user, 0) + 1
                    server.temperatures.append(body.get("temperature"))
                    first = server.seen[user] == 1
                    done = sum(server.answered.values())
                    block = server.block_after is not None and done >= server.block_after
                    if block:
                        server.blocked += 1
                if block:
                    server.release.wait()
                    self.close_connection = True
                    return None  # no reply: the client that asked is gone
                scripted = server.reply_fn(user) if server.reply_fn else None
                if scripted is not None:
                    text = scripted
                elif server.refuse:
                    text = "I'm sorry, but I can't help with analysing this text."
                elif server.empty_first and first:
                    text = ""
                else:
                    answer = expected_answer(user)
                    text = f"<explanation>{answer.split(' after ')[0] if server.token_only else answer}</explanation>"
                    with server.lock:
                        server.answered[user] = server.answered.get(user, 0) + 1
                usage = {"prompt_tokens": len(user.split()), "completion_tokens": len(text.split()), "total_tokens": 0}
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}], "usage": usage})


        self.httpd = LoopbackServer(Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        return False
