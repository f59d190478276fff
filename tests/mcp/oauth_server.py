"""An MCP server that requires OAuth 2.1 bearer tokens (the official
Python SDK's resource-server support: protected-resource metadata, a 401
with `WWW-Authenticate: Bearer resource_metadata=…`, tokens checked to be
for this resource), and beside it a small authorization-server stand-in
(standard library only), for toolfleet's tests.

Usage: oauth_server.py MCP_PORT AS_PORT LOG

- the MCP server: http://127.0.0.1:MCP_PORT/mcp, a tool `whoami` that
  answers with the OAuth client id of the token it was called with, and
  a tool `slow` that answers after `seconds`;
- the authorization server: http://127.0.0.1:AS_PORT, RFC 8414 metadata
  and a token endpoint for the client-credentials grant (client
  authentication by HTTP Basic) that REFUSES a request whose `resource`
  parameter is missing or is not the MCP server's URL (`invalid_target`),
  and a client whose secret is wrong (`invalid_client`); each token
  request is written to LOG as a JSON line (client id, resource, outcome:
  never a secret). Its tokens live TOKEN_LIFETIME seconds (an environment
  variable; 600 when not set).
"""

import asyncio
import base64
import json
import os
import secrets
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

MCP_PORT, AS_PORT, LOG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
RESOURCE = f"http://127.0.0.1:{MCP_PORT}/mcp"
ISSUER = f"http://127.0.0.1:{AS_PORT}"
# The clients the authorization server knows, and their secrets.
CLIENTS = {
    "fleet": "default-s3cret-9f2a",
    "fleet-acme": "acme-s3cret-7c1b",
    "fleet-globex": "globex-s3cret-55aa",
}
LIFETIME = int(os.environ.get("TOKEN_LIFETIME", "600"))
TOKENS: dict = {}  # token -> (client id, resource, expires at)
LOCK = threading.Lock()


def log(entry: dict) -> None:
    with LOCK, open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


class AuthorizationServer(BaseHTTPRequestHandler):
    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/.well-known/oauth-authorization-server":
            self.answer(200, {
                "issuer": ISSUER,
                "token_endpoint": f"{ISSUER}/token",
                "grant_types_supported": ["client_credentials"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic"],
                "response_types_supported": ["token"],
            })
        else:
            self.answer(404, {"error": "not_found"})

    def client(self) -> str | None:
        """The client id of a good HTTP Basic authentication."""
        header = self.headers.get("authorization", "")
        if not header.lower().startswith("basic "):
            return None
        try:
            decoded = base64.b64decode(header[6:]).decode()
        except ValueError:
            return None
        client_id, _, secret = decoded.partition(":")
        client_id, secret = urllib.parse.unquote_plus(client_id), urllib.parse.unquote_plus(secret)
        return client_id if CLIENTS.get(client_id) == secret else None

    def do_POST(self) -> None:
        if self.path != "/token":
            self.answer(404, {"error": "not_found"})
            return
        length = int(self.headers.get("content-length", "0"))
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        resource = form.get("resource", [None])[0]
        client_id = self.client()
        entry = {"resource": resource, "grant_type": form.get("grant_type", [None])[0],
                 "scope": form.get("scope", [None])[0]}
        if client_id is None:
            log({**entry, "outcome": "invalid_client"})
            self.answer(401, {"error": "invalid_client", "error_description": "client authentication failed"})
            return
        entry["client_id"] = client_id
        if entry["grant_type"] != "client_credentials":
            log({**entry, "outcome": "unsupported_grant_type"})
            self.answer(400, {"error": "unsupported_grant_type"})
            return
        if resource != RESOURCE:
            log({**entry, "outcome": "invalid_target"})
            self.answer(400, {"error": "invalid_target",
                              "error_description": f"the resource parameter must name {RESOURCE}"})
            return
        token = secrets.token_urlsafe(24)
        with LOCK:
            # Checked at each request; kept a while past its expiry, so a
            # call that started with it may still run to its end.
            TOKENS[token] = (client_id, resource, int(time.time()) + LIFETIME + 60)
        log({**entry, "outcome": "issued"})
        self.answer(200, {"access_token": token, "token_type": "Bearer", "expires_in": LIFETIME, "scope": "tides"})

    def log_message(self, format: str, *args) -> None:
        pass


class Verifier:
    """Checks a bearer token against the tokens issued."""

    async def verify_token(self, token: str) -> AccessToken | None:
        with LOCK:
            issued = TOKENS.get(token)
        if issued is None:
            return None
        client_id, resource, expires_at = issued
        return AccessToken(token=token, client_id=client_id, scopes=["tides"],
                           expires_at=expires_at, resource=resource)


server = MCPServer(
    "tides",
    token_verifier=Verifier(),
    auth=AuthSettings(issuer_url=ISSUER, resource_server_url=RESOURCE,
                      required_scopes=["tides"], validate_token_resource=True),
)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def whoami() -> str:
    """Says which OAuth client called."""
    token = get_access_token()
    return f"called by client {token.client_id if token else 'nobody'}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def slow(seconds: float) -> str:
    """Answers after `seconds`."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}s"


if __name__ == "__main__":
    authorization = ThreadingHTTPServer(("127.0.0.1", AS_PORT), AuthorizationServer)
    threading.Thread(target=authorization.serve_forever, daemon=True).start()
    print(f"tides MCP server on {RESOURCE}, authorization server {ISSUER}", file=sys.stderr)
    server.run("streamable-http", host="127.0.0.1", port=MCP_PORT)
