"""The dashboard: `GET /ui` serves one self-contained page (ui_page.html), `GET /` redirects to it.

The page has no build step and loads nothing from elsewhere: its script and style are inline,
and everything it shows comes from the daemon's own API (/api/status, /api/config, /metrics),
fetched by the page with the user's API key when one is set.
Invariants:
- The page itself holds no state and no secret, so it is served without the API key (a browser
  cannot send one when it navigates); every request the page makes for state or actions needs
  the key like any other client's. The key lives in the tab's sessionStorage only.
- The page runs under a Content-Security-Policy that allows only its own inline script and style
  (by hash), requests to this origin, and no framing (no clickjacking of its buttons). It never
  writes data as HTML (textContent only), so a model name or an error message cannot inject.
- Its requests are same-origin JSON, so they pass the WebGuard; a foreign page gets no further
  than before.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

PAGE_FILE = "ui_page.html"
UI_PATH = "/ui"


def _hashes(page: str, tag: str) -> str:
    """CSP source expressions for the contents of every inline <tag> of the page."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


class Dashboard:
    """The page's bytes and headers, read once when the gateway is built."""

    def __init__(self) -> None:
        page = resources.files("supervisor.gateway").joinpath(PAGE_FILE).read_text(encoding="utf-8")
        self.body = page.encode()
        csp = (f"default-src 'none'; script-src {_hashes(page, 'script')}; style-src {_hashes(page, 'style')}; "
               "connect-src 'self'; img-src data:; media-src blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        self.headers = {"Content-Security-Policy": csp, "X-Frame-Options": "DENY", "Cache-Control": "no-cache",
                        "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}

    async def page(self, request: Request) -> Response:
        return Response(self.body, media_type="text/html; charset=utf-8", headers=self.headers)

    async def root(self, request: Request) -> Response:
        return RedirectResponse(UI_PATH, status_code=307)
