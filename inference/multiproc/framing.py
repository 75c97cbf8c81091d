"""Messages between the serving process, worker processes and engine servers: a 4-byte
little-endian length, then a pickle (protocol 5). Only ever between processes of this
user, over socket pairs or a Unix socket in a mode-0700 folder (pickle runs code: never
read one from anyone else)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

from inference.batching.errors import BatcherClosed, BusyError, DeadlineExceeded
from inference.engines.base import EngineError

_HEADER = struct.Struct("<I")


def frame(obj: Any) -> bytes:
    """One message as bytes to write."""
    data = pickle.dumps(obj, protocol=5)
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """One message from an asyncio stream; raises ``asyncio.IncompleteReadError`` at end of file."""
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def send_frame(sock: socket.socket, obj: Any) -> None:
    """Send one message on a blocking socket; raises OSError."""
    sock.sendall(frame(obj))


def recv_frame(sock: socket.socket) -> Any:
    """Receive one message from a blocking socket.

    Raises:
        ConnectionError: the peer closed the connection (also mid-message).
        OSError: the socket failed or timed out (``socket.timeout``).
    """
    (n,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return buf


#: The errors a worker process sends back by name (``("err", id, kind, message)``), raised again
#: in the serving process; any other failure travels as ``EngineError``.
ERRORS: dict[str, type[Exception]] = {"BusyError": BusyError, "BatcherClosed": BatcherClosed,
                                      "DeadlineExceeded": DeadlineExceeded, "EngineError": EngineError}
