"""The listening socket of the server and of the router (a module of its own: the router imports
no engine)."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, made as TCP by name: asyncio turns TCP_NODELAY on only for sockets
    whose `proto` is IPPROTO_TCP (accepted ones inherit it). Without it a response written as
    headers, then body waited ~40 ms on a kept-alive connection for the client's delayed ACK
    (Nagle), on every non-streamed request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise SystemExit(
            f"error: cannot listen on {host}:{port}: {error.strerror}; pick another --port"
        ) from None
    return sock
