"""The server's listening socket: what its accepted connections do before any HTTP is spoken."""

from __future__ import annotations

import asyncio
import socket

from pagedllm.entrypoints.openai.listen_socket import bind_socket


def _nodelay_of_an_accepted_connection(sock: socket.socket) -> int:
    async def main() -> int:
        seen: dict[str, int] = {}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw = writer.get_extra_info("socket")
            seen["nodelay"] = raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves it: create_server
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()
        return seen["nodelay"]

    return asyncio.run(main())


def test_accepted_connections_send_without_waiting_for_the_clients_ack():
    """TCP_NODELAY on every accepted connection: asyncio sets it only where the listening socket
    says it is TCP. Without it a non-streamed response (headers, then body) on a kept-alive
    connection waited for the client's delayed ACK, ~40 ms a request."""
    assert _nodelay_of_an_accepted_connection(bind_socket("127.0.0.1", 0)) != 0
