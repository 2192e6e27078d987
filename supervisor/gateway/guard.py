"""Who may drive the daemon: Host, Origin and body-type checks in front of every route (ASGI).

Any web page the user opens can send requests to 127.0.0.1. This middleware keeps such a page
from reading the API or running anything:
- DNS rebinding (a foreign name that resolves to 127.0.0.1, so the page is "same-origin" with
  us in the browser's eyes): only a Host that names this server passes: `localhost`, a loopback
  address (127.0.0.0/8, ::1), the configured host, or a name in `[server] allowed_hosts`.
  Otherwise 403 `host_not_allowed`.
- Cross-origin requests: a request carrying an Origin that is neither this server's own (the
  scheme, host and port it was sent to) nor in `[server] allowed_origins` is refused with 403
  `origin_not_allowed`, whatever its method. Only browsers send Origin; a foreign page has no
  business reading /api/status or /v1/models either, and one rule leaves nothing to forget when
  a route is added (the dashboard at /ui among them).
- "Simple" requests that skip the CORS preflight: a request body must be JSON
  (`application/json`, charset UTF-8 if one is named), else 415. A browser cannot send that
  type cross-origin without a preflight, which only allowed origins pass. A POST without a body
  (`curl -X POST .../evict`) needs no type. On the `untyped` paths (Ollama's API, whose clients, LiteLLM's among
  them, send JSON with no type), a body with no Content-Type at all passes when the request has no Origin: every
  browser sends one with a POST, so it is no page's request (and a foreign one is refused above). On the
  `multipart` paths (OpenAI's audio uploads) a `multipart/form-data` body passes: a browser may send one without a
  preflight, but only with an Origin, refused above unless it is allowed.
- CORS preflights are answered (204) for allowed origins only; their actual responses carry
  Access-Control-Allow-Origin. Preflights carry no credentials, so this runs before the API key.

Refusals are 403 with an OpenAI error body: not 421 (it invites a client to retry on another
connection) nor 400 (the request is well-formed; this server just will not serve it).
Invariant: a refused request is answered here, before the app sees it and before its body is
read, so nothing it asked for happens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor import errors
from supervisor.hosts import DEFAULT_PORTS, Origin, host_name, is_loopback, parse_origin, split_host

CORS_METHODS = "GET, HEAD, POST, OPTIONS"
CORS_HEADERS = "authorization, content-type"
CORS_MAX_AGE_S = 600
_TOKEN_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")
_JSON_TYPE = re.compile(r"^application/json\s*(;\s*charset\s*=\s*\"?utf-8\"?\s*)?$", re.IGNORECASE)


class WebGuard:
    """ASGI middleware applying the rules above to every HTTP and WebSocket request."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] = (), origins: Iterable[str] = (),
                 untyped: Iterable[str] = (), multipart: Iterable[str] = (),
                 error_body: Callable[[str, errors.MlxsupError], dict] = lambda path, exc: exc.body()) -> None:
        self.app = app
        self.error_body = error_body  # a refusal's body, by path (Ollama's paths answer in Ollama's shape)
        self.untyped = frozenset(p for p in untyped if not p.endswith("/"))
        self.multipart = frozenset(multipart)  # paths whose bodies are multipart/form-data (audio uploads)
        self.untyped_under = tuple(p for p in untyped if p.endswith("/"))  # a path ending in "/": every path under it
        self.host_names = {h for h in map(host_name, hosts) if h is not None}
        self.origins: set[Origin] = set()
        for value in origins:
            origin = parse_origin(value)
            if origin is None:
                raise ValueError(f"not an origin (scheme://host[:port]): {value!r}")
            self.origins.add(origin)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            cors_origin = self._check(scope, headers)
        except errors.MlxsupError as exc:
            await self._refuse(scope, receive, send, exc)
            return
        if cors_origin is not None and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(cors_origin, headers)(scope, receive, send)
            return
        if cors_origin is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                response_headers["Access-Control-Allow-Origin"] = cors_origin
                response_headers.add_vary_header("Origin")
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _check(self, scope: Scope, headers: Headers) -> str | None:
        """Raise the refusal of this request, or return the Origin that CORS headers must name (None: none)."""
        hosts = headers.getlist("host")
        target = split_host(hosts[0]) if len(hosts) == 1 else None
        if target is None or not (is_loopback(target[0]) or target[0] in self.host_names):
            shown = ", ".join(hosts)[:100] or "none"
            raise errors.HostNotAllowed(
                f"this server does not answer to the Host {shown!r}: add the name to [server] allowed_hosts if "
                "clients reach the daemon by it (a foreign name pointing at this machine is how DNS rebinding "
                "attacks work)")
        cors_origin = None
        if origins := headers.getlist("origin"):
            origin = parse_origin(origins[0]) if len(origins) == 1 else None
            scheme = {"ws": "http", "wss": "https"}.get(scope["scheme"], scope["scheme"])
            own = (scheme, target[0], target[1] if target[1] is not None else DEFAULT_PORTS.get(scheme or ""))
            if origin is None or (origin != own and origin not in self.origins):
                raise errors.OriginNotAllowed(
                    f"requests from the web origin {', '.join(origins)[:100]!r} are not allowed: add it to "
                    "[server] allowed_origins to let its pages use this server")
            cors_origin = None if origin == own else origins[0]  # same-origin needs no CORS grant
        untyped = scope["path"] in self.untyped or scope["path"].startswith(self.untyped_under)
        uploads = scope["path"] in self.multipart and headers.get("content-type", "").startswith("multipart/form-data")
        if scope["type"] == "http" and not uploads and \
                not (untyped and "content-type" not in headers and "origin" not in headers):
            _check_body_type(scope["method"], headers)
        return cors_origin

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: errors.MlxsupError) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": exc.code})
            return
        await JSONResponse(self.error_body(scope["path"], exc), status_code=exc.status)(scope, receive, send)


def _check_body_type(method: str, headers: Headers) -> None:
    """A body must be declared JSON; a request without one (or a GET, HEAD, OPTIONS) needs no type."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return
    content_type = headers.get("content-type")
    if content_type is None:
        declared = headers.get("content-length", "0").strip()
        if declared in ("", "0") and "transfer-encoding" not in headers:
            return
    elif _JSON_TYPE.match(content_type.strip()):
        return
    shown = (content_type or "none")[:100]
    raise errors.UnsupportedMediaType(
        f"the request body must be JSON: send 'Content-Type: application/json' (got {shown!r})")


def _preflight(origin: str, headers: Headers) -> Response:
    requested = headers.get("access-control-request-headers", "").strip()
    allow = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": CORS_METHODS,
        "Access-Control-Allow-Headers": requested if _TOKEN_LIST.match(requested) else CORS_HEADERS,
        "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    }
    if headers.get("access-control-request-private-network") == "true":  # Chrome's Private Network Access
        allow["Access-Control-Allow-Private-Network"] = "true"
    return Response(status_code=204, headers=allow)
