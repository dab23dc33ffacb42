"""An OpenAI-compatible /v1/completions server that fails on cue, for the failure cases of
`rollout.name=remote` (4xx, 5xx, a server that is down and comes back). A real server cannot be
made to fail on cue; the real one (vLLM on the CPU) is in test_remote_vllm.py.

Its answer to a prompt of ids [p0, ...] is the ids [p0 + 1, p0 + 2, ...] with logprob -0.5 each,
in vLLM's shape (`choices[0].token_ids`, `logprobs.token_logprobs`), or SGLang's
(`logprobs.tokens` as "token_id:N") with `ids_as_tokens=True`. Every request's method, path and
headers are recorded in `received` (what a client sent, e.g. its Authorization header).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedServer:
    def __init__(self, port: int = 0, model: str = "scripted-model", delay: float = 0.0, ids_as_tokens: bool = False):
        self.model = model
        self.delay = delay
        self.ids_as_tokens = ids_as_tokens
        self.requests: list[dict] = []
        self.received: list[tuple[str, str, dict[str, str]]] = []
        """(method, path, headers with lower-case names) of every request, in arrival order."""
        self.fail_next: list[int] = []
        """HTTP statuses to answer the next completion requests with, in order."""
        self.healthy = True
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _record(self) -> None:
                with server._lock:
                    server.received.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

            def do_GET(self):
                self._record()
                if self.path == "/health":
                    self._send(200 if server.healthy else 503, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": server.model}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                self._record()
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with server._lock:
                    server.requests.append(request)
                    status = server.fail_next.pop(0) if server.fail_next else 200
                if server.delay:
                    time.sleep(server.delay)
                if status != 200:
                    self._send(status, {"error": {"message": f"scripted failure {status}"}})
                    return
                first = request["prompt"][0]
                ids = [first + 1 + i for i in range(request["max_tokens"])]
                choice = {"text": "", "finish_reason": "length", "logprobs": {"token_logprobs": [-0.5] * len(ids)}}
                if server.ids_as_tokens:
                    choice["logprobs"]["tokens"] = [f"token_id:{i}" for i in ids]
                else:
                    choice["token_ids"] = ids
                self._send(200, {"choices": [choice], "model": server.model})

        return Handler
