"""Host and Origin values, parsed and normalized: pure functions shared by the configuration (which
checks `allowed_hosts` / `allowed_origins` at start) and the gateway's web guard (which checks each
request). No HTTP framework here, so the lifecycle core can use them without importing the gateway.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}

Origin = tuple[str, str, int | None]  # scheme, host (lower case, no brackets), port (default filled in)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (host, port): lower case, IPv6 without brackets, no trailing dot; None if malformed."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
    elif value.count(":") > 1:
        return None  # a bare IPv6 address is not a valid Host
    else:
        host, colon, port_text = value.partition(":")
        rest = colon + port_text
    digits = rest[1:]
    if rest and not (rest[0] == ":" and digits.isascii() and digits.isdigit() and int(digits[:6]) <= 65535):
        return None
    host = host.lower().removesuffix(".")
    if not host or any(c.isspace() or c in "/@[]" for c in host):
        return None
    return host, int(digits) if rest else None


def host_name(value: str) -> str | None:
    """A configured host ('name', '10.0.0.2', '::1' or '[::1]'), normalized as split_host does; None if it
    is malformed or carries a port."""
    bare_ipv6 = value.count(":") > 1 and not value.startswith("[")
    parts = split_host(f"[{value}]" if bare_ipv6 else value)
    return parts[0] if parts is not None and parts[1] is None else None


def parse_origin(value: str) -> Origin | None:
    """`scheme://host[:port]` as an Origin tuple, or None ("null", paths, user info, garbage)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.username is not None or parts.password is not None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    scheme = parts.scheme.lower()
    return scheme, parts.hostname.lower().removesuffix("."), port if port is not None else DEFAULT_PORTS.get(scheme)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
