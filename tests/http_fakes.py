"""What the tests' fake vLLM servers share: a quiet request handler that answers JSON and
completions (streamed or not), and starting one on a free loopback port."""

from __future__ import annotations

import http.server
import json
import threading
import time


class JsonHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _complete(self, body, delay_s=0.0):
        """A completion of ``max_tokens`` tokens 100, 101, ... (runner-up 7), after ``delay_s``."""
        n = body["max_tokens"]
        lp = {"tokens": [f"token_id:{100 + i}" for i in range(n)],
              "top_logprobs": [{f"token_id:{100 + i}": -0.1, "token_id:7": -3.0} for i in range(n)]}
        choice = {"text": "x" * n, "logprobs": lp, "finish_reason": "length"}
        if not body.get("stream"):
            time.sleep(delay_s)
            self._json(200, {"choices": [choice]})
            return
        self.send_response(200)  # HTTP/1.0: the body ends when the connection closes
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.flush()
        time.sleep(delay_s)
        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode())


def serve(handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    """``handler`` served on 127.0.0.1 in a daemon thread: the server and its base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
