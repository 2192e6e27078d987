"""The second listener, on Ollama's address: apps that find a server only by probing 127.0.0.1:11434
reach the same gateway there (the Ollama API and the OpenAI and Anthropic routes, as Ollama serves them, behind the
same Host/Origin guard and API key: it is the same app, on one more socket of the same server).

`[server] ollama_listen` (or MLXSUP_OLLAMA_LISTEN) says where: "HOST:PORT" (default 127.0.0.1:11434), or "off"
(also "" or "false"). On by default when the port is free; when it is taken (a running Ollama, most often) the
daemon serves on its own port alone, says so in one log line and in /api/status (`ollama_listener`). A taken port
is never an error: mlxsup's own port is the one it must have.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.config import Settings
from supervisor.config import listen_address as address

log = logging.getLogger(__name__)


@dataclass
class ListenerStatus:
    address: str | None = None
    state: str = "off"  # off | listening | taken (the port is in use) | failed (another reason)
    error: str | None = None

    def to_dict(self) -> dict:
        return {"address": self.address, "state": self.state, "error": self.error}


STATUS = ListenerStatus()  # this daemon's (one per process), for /api/status


def open_listener(settings: Settings, main_port: int, listen: Callable[[str, int], socket.socket]
                  ) -> socket.socket | None:
    """The socket on Ollama's address, bound and listening by `listen` (the daemon's own, which raises for a port it
    cannot have), or None: off, the same as the main one, or not to be had (logged, and said in STATUS)."""
    STATUS.address, STATUS.state, STATUS.error = None, "off", None
    try:
        where = address(settings.ollama_listen)
    except ValueError as exc:
        STATUS.state, STATUS.error = "failed", str(exc)
        log.warning("[ollama] %s: no Ollama listener", exc)
        return None
    if where is None:
        return None
    host, port = where
    STATUS.address = f"{host}:{port}"
    if port == main_port and host == settings.host:
        STATUS.state = "listening"  # mlxsup's own port is Ollama's
        return None
    try:
        sock = listen(host, port)
    except Exception as exc:  # the daemon's StartupError: the port is taken, or the address is not this host's
        taken = os.strerror(errno.EADDRINUSE) in str(exc)
        STATUS.state, STATUS.error = ("taken" if taken else "failed"), str(exc)
        log.warning("[ollama] %s is %s (%s): apps that look for Ollama there will not find mlxsup; set "
                    "[server] ollama_listen to another HOST:PORT, or \"off\"", STATUS.address,
                    "taken, by a running Ollama or another server" if taken else "not available", exc)
        return None
    STATUS.state = "listening"
    return sock
