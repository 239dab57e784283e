"""A small HTTP server on 127.0.0.1 for the tests of rewards served over HTTP: an OpenAI-compatible
``POST /v1/chat/completions`` (enough for the ``openai`` SDK) and any other JSON ``POST`` route, answered by a
function of the test.

    with Loopback(lambda request: chat_reply("7")) as server:
        judge = Judge(model="m", base_url=server.base_url)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    path: str
    body: Any
    headers: dict[str, str]  # names in lower case


@dataclass
class Reply:
    """What the server answers: ``body`` (JSON-encoded unless it is ``str``) with ``status``, after ``delay`` s."""

    body: Any = None
    status: int = 200
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def chat_reply(text: str, model: str = "judge") -> Reply:
    """An OpenAI chat completion whose only choice says ``text``."""
    return Reply(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def user_message(request: Request) -> str:
    """The last user message of a chat completion request."""
    return [m for m in request.body["messages"] if m["role"] == "user"][-1]["content"]


class Loopback:
    """A threaded HTTP server on a free loopback port; ``answer(request) -> Reply | dict | list | str`` (a bare
    value is a 200 JSON body; a str a chat completion saying it). Every request is kept in ``requests``."""

    def __init__(self, answer: Callable[[Request], Any]):
        self.answer, self.requests = answer, []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = Request(
                    self.path, json.loads(raw) if raw else None, {k.lower(): v for k, v in self.headers.items()}
                )
                with server.lock:
                    server.requests.append(request)
                reply = server.answer(request)
                if isinstance(reply, str):
                    reply = chat_reply(reply)
                elif not isinstance(reply, Reply):
                    reply = Reply(reply)
                time.sleep(reply.delay)
                data = (reply.body if isinstance(reply.body, str) else json.dumps(reply.body)).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout test)
                    pass

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.request_queue_size = 256  # connections waiting to be accepted (the default 5 drops some)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, name="loopback", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL."""
        return f"{self.url}/v1"

    def __enter__(self) -> Loopback:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
