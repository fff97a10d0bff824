"""The HTTP side of ``opd serve``: routes, bodies read within a size and a time limit, connections
bounded, a defect answered with 500 while the server keeps serving."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opd.models import load_causal_lm, load_tokenizer
from opd.serve.fields import RequestError, error_body
from opd.serve.model import ScoringModel, ServerBusy
from opd.serve.wire import completions_response, generate_response, models_response


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server: body size, time to send it, connections held at once."""

    max_request_bytes: int = 16 * 2**20
    """Larger bodies get 413 before they are read (8 sequences of 32k tokens take about 2 MiB)."""
    request_timeout_s: float = 60.0
    """A client that takes longer to send its request (or sits idle on a kept-alive connection) is
    dropped."""
    max_connections: int = 64
    """Connections served at once; more wait in the listen backlog (256) until one finishes."""
    max_waiting: int = 256
    """Requests for the model held at once (served or waiting their turn); more get 503 with a
    ``Retry-After`` (a sampling request is a row, as clients send them)."""


def make_handler(scorer: ScoringModel, limits: ServerLimits = ServerLimits()):
    """An HTTP handler class bound to ``scorer``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.request_timeout_s  # socket timeout: a silent client is dropped

        def log_message(self, format, *args):
            return

        def _send(self, status: int, payload: dict, retry_after_s: int | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if retry_after_s is not None:
                self.send_header("Retry-After", str(retry_after_s))
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None) -> None:
            self._send(status, error_body(message, status, param))

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, models_response(scorer))
            else:
                self._error(404, f"no route {self.path}")

        def _read_body(self) -> bytes:
            """The request body, within the size limit and the time limit, or a RequestError."""
            declared = self.headers.get("Content-Length")
            if declared is None:
                self.close_connection = True
                raise RequestError("a Content-Length header is required", 411)
            if not declared.strip().isdigit():
                self.close_connection = True
                raise RequestError(f"Content-Length {declared[:40]!r} is not a byte count")
            length = int(declared)
            if length > limits.max_request_bytes:
                self.close_connection = True  # the body is left unread
                raise RequestError(
                    f"the request body is {length} bytes, over this server's limit of "
                    f"{limits.max_request_bytes} (--max-request-bytes)",
                    413,
                )
            deadline = time.monotonic() + limits.request_timeout_s
            chunks, remaining = [], length
            while remaining:
                chunk = self.rfile.read1(min(remaining, 2**16))
                if not chunk or time.monotonic() > deadline:
                    self.close_connection = True
                    raise RequestError(
                        f"the request body ended or stalled after {length - remaining} of {length} "
                        "bytes",
                        408,
                    )
                chunks.append(chunk)
                remaining -= len(chunk)
            return b"".join(chunks)

        def do_POST(self):
            routes = {"/v1/completions": completions_response, "/generate": generate_response}
            try:
                body = self._read_body()
                if self.path not in routes:
                    raise RequestError(f"no route {self.path}", 404)
                request = json.loads(body or b"null")
                if not isinstance(request, dict):
                    raise RequestError("the request body must be a JSON object")
                with scorer.admitted():
                    answer = routes[self.path](scorer, request)
                self._send(200, answer)
            except ServerBusy as busy:
                self._send(503, error_body(str(busy), 503), busy.retry_after_s)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self._error(400, "the request body is not valid JSON")
            except RecursionError:
                self._error(400, "the request body is nested too deeply")
            except RequestError as error:
                self._error(error.status, str(error), error.param)
            except (TimeoutError, ConnectionError):
                self.close_connection = True
            except (
                Exception
            ) as error:  # a defect of the server, not of the request: say so, keep serving
                traceback.print_exc(file=sys.stderr)
                self.close_connection = True
                self._send(
                    500,
                    {"error": {"message": f"internal server error: {error!r}"[:300], "code": 500}},
                )

    return Handler


class LimitedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; further ones wait their turn.

    At the cap the accept loop waits for a connection to finish before accepting the next, so
    waiting clients queue in the kernel's listen backlog (first come, first served, bounded by
    ``request_queue_size``) instead of being refused: a burst costs latency, not failed requests.
    """

    daemon_threads = True
    request_queue_size = (
        256  # the listen backlog: socketserver's 5 makes bursts wait a second per SYN retry
    )

    def __init__(self, address, handler, limits: ServerLimits):
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.slots.acquire()
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        """A client that hung up or timed out is routine; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    name: str | None = None,
    max_logprobs: int = 20,
    max_tokens_per_request: int = 16384,
    dtype: str = "auto",
    device: str = "auto",
    limits: ServerLimits = ServerLimits(),
) -> None:
    """Load the model and answer requests until interrupted."""
    tokenizer = load_tokenizer(model_path, "model")
    model = load_causal_lm(model_path, "model", dtype=dtype, device=device)
    scorer = ScoringModel(
        model,
        tokenizer,
        name or model_path,
        max_logprobs,
        max_tokens_per_request,
        limits.max_waiting,
    )
    server = LimitedServer((host, port), make_handler(scorer, limits), limits)
    print(f"opd serve: {scorer.name} on http://{host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        scorer.close()
