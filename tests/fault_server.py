"""A deliberately faulty teacher server, run as a real process by the fault tests.

    python tests/fault_server.py MODE PORT
MODE: slow (answers after 5 s), few (one log-prob short), wrong_ids (log-probs for other
tokens), badjson (not JSON), error500 (always HTTP 500), nan (a NaN log-prob); and the faults a
run survives: flaky (every other request HTTP 500), late (every third request answered after
5 s), reorder (choices in reverse order), busy (every other request HTTP 503 with Retry-After:
1), ok (honest answers); replicas (two models behind one
address, as a round-robin balancer over two servers of different weights would be: every other
request answered with the log-prob -2 - (token id mod 5) / 10). Honest answers give every token
the log-prob -1 - (token id mod 7) / 10.
"""

import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE, PORT = sys.argv[1], int(sys.argv[2])
COUNTER = itertools.count()
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        return

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with LOCK:
            number = next(COUNTER)
        if MODE == "slow" or (MODE == "late" and number % 3 == 1):
            time.sleep(5)
        if MODE == "flaky" and number % 2 == 0:
            self._send(500, b'{"message": "overloaded"}')
            return
        if MODE == "busy" and number % 2 == 0:
            self._send(503, b'{"error": {"message": "busy"}}', {"Retry-After": "1"})
            return
        if MODE == "error500":
            self._send(500, b'{"message": "overloaded"}')
            return
        if MODE == "badjson":
            self._send(200, b"<html>not json</html>")
            return
        choices = []
        for index, ids in enumerate(body["prompt"]):
            entries = [None] + [
                {str(t): {"logprob": -1.0 - (t % 7) / 10, "rank": 1}} for t in ids[1:]
            ]
            if MODE == "replicas" and number % 2 == 1:
                entries = [None] + [
                    {str(t): {"logprob": -2.0 - (t % 5) / 10, "rank": 1}} for t in ids[1:]
                ]
            if MODE == "few":
                entries = entries[:-1]
            if MODE == "wrong_ids":
                entries = [None] + [{str(t + 1): {"logprob": -1.0, "rank": 1}} for t in ids[1:]]
            if MODE == "nan":
                entries[-1] = {str(ids[-1]): {"logprob": float("nan"), "rank": 1}}
            choices.append({"index": index, "prompt_logprobs": entries})
        if MODE == "reorder":
            choices.reverse()
        self._send(200, json.dumps({"choices": choices}).encode())

    def _send(self, status, data, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
