"""A webhook receiver that verifies deliveries with the official Standard
Webhooks library (`standardwebhooks` from PyPI, installed by
scripts/ensure-servers), as a team receiving toolfleet's webhooks would.

Usage: standard_webhooks_receiver.py '{"<name>": "whsec_...", ...}'

Listens on 127.0.0.1 (a free port) and prints one JSON line per event on
stdout: first {"port": N}, then for each POST:
{"path", "key", "id", "timestamp", "signature", "verified", "error", "event"}.
POST /<name> verifies with the secret <name> and answers 204, or 401 when
the library refuses the delivery. POST /flaky-<name> answers 503 to the
first delivery of each webhook-id (before verifying), then as /<name>.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

SECRETS = json.loads(sys.argv[1])
LOCK = threading.Lock()
SEEN_FLAKY = set()


def say(line):
    with LOCK:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        path = self.path.strip("/")
        flaky = path.startswith("flaky-")
        key = path[len("flaky-") :] if flaky else path
        headers = {k: v for (k, v) in self.headers.items()}
        line = {
            "path": path,
            "key": key,
            "id": headers.get("webhook-id"),
            "timestamp": headers.get("webhook-timestamp"),
            "signature": headers.get("webhook-signature"),
            "tenant": self.headers.get("Toolfleet-Tenant"),
            "verified": False,
            "error": None,
            "event": None,
        }
        if flaky:
            with LOCK:
                first = line["id"] not in SEEN_FLAKY
                SEEN_FLAKY.add(line["id"])
            if first:
                line["error"] = "flaky: 503 to the first delivery"
                say(line)
                self.send_response(503)
                self.end_headers()
                return
        try:
            # The raw body as received, never re-serialised JSON.
            line["event"] = Webhook(SECRETS[key]).verify(body, headers)
            line["verified"] = True
            status = 204
        except (WebhookVerificationError, KeyError) as e:
            line["error"] = f"{type(e).__name__}: {e}"
            status = 401
        say(line)
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
say({"port": server.server_address[1]})
server.serve_forever()
