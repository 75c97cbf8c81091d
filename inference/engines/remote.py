"""Remote engine: the :class:`~inference.engines.base.Engine` protocol over a Unix
socket to this GPU's engine server (inference/multiproc/engine_server.py, issue 6).

A worker process started with an engine server (``inference.engine_server``)
loads this in place of its GPU engine: its tokenizer, dynamic batcher, pool and
CPU fallback stay as they are, and each padded batch is sent to the server,
which merges it with the other worker processes' batches. One batch in flight
per engine instance. The pool awaits :meth:`RemoteEngine.infer_async` on its
event loop (no engine thread, so no hand-over of the GIL per batch; measured
with a GPU-like engine double, docs/benchmarks.md); :meth:`RemoteEngine.infer`
is the blocking form (the bench's engine-only run, tests).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np

from inference.engines.base import EngineError, check_batch
from inference.multiproc.framing import frame, read_frame, recv_frame, send_frame


class RemoteEngine:
    """An engine whose batches run in the engine server at ``path``.

    Args:
        path: the server's Unix socket.
        expect: the engine name this stands in for (``"torch_cuda"``, ``"tensorrt"``):
            a server that loaded another engine is refused, so the worker's
            ``inference.engine_order`` moves on as if this one failed to load.
        timeout_s: seconds to wait for a batch's result (then the batch fails and the
            connection is dropped; the next call connects again).

    Attributes (from the server's ``hello``): ``name``, ``dim``, ``max_batch_size``,
    ``max_seq_len``, ``precision``, ``gpu_memory_bytes``, ``device``.

    Raises:
        EngineError: the server cannot be reached, or hosts another engine than ``expect``.
    """

    def __init__(self, path: str, expect: str, timeout_s: float) -> None:
        self.path = path
        self.expect = expect
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        info = self._connect()
        if info["name"] != expect:
            self.close()
            raise EngineError(f"the engine server at {path} runs {info['name']}, not {expect}")
        self.name: str = info["name"]
        self.dim: int = int(info["dim"])
        self.max_batch_size: int = int(info["max_batch_size"])
        self.max_seq_len: int = int(info["max_seq_len"])
        self.precision: str = str(info["precision"])
        self.gpu_memory_bytes: int | None = info.get("gpu_memory_bytes")
        self.device: Any = info.get("device")

    def _connect(self) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            kind, info = recv_frame(sock)
        except (OSError, ConnectionError, ValueError) as exc:
            sock.close()
            raise EngineError(f"engine server at {self.path} unreachable: {exc!r}") from None
        if kind != "hello":
            sock.close()
            raise EngineError(f"engine server at {self.path} answered {kind!r} instead of hello")
        self._sock = sock
        return info

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Run one padded batch in the server (:meth:`inference.engines.base.Engine.infer`).

        Args:
            input_ids / attention_mask: int64[B, T], B ≤ ``max_batch_size``.

        Returns:
            float32[B, D], mean-pooled, not normalized.

        Raises:
            EngineError: bad shapes; the server failed the batch, did not answer within
                ``timeout_s``, or is unreachable (restarting).
        """
        request = self._request(input_ids, attention_mask)
        if self._sock is None:
            self._connect()
        try:
            send_frame(self._sock, request)
            reply = recv_frame(self._sock)
        except (OSError, ConnectionError) as exc:
            self.close()  # a late answer must not be read as the next batch's
            raise EngineError(f"engine server at {self.path}: {exc!r}") from None
        return _result(reply)

    async def infer_async(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """:meth:`infer` on the running event loop, over this engine's own asyncio connection
        (opened at the first call, again after a failure). Same arguments, result and errors."""
        request = self._request(input_ids, attention_mask)
        try:
            async with asyncio.timeout(self.timeout_s):  # no task per call, unlike wait_for
                if self._stream is None:
                    self._stream = await asyncio.open_unix_connection(self.path)
                    await read_frame(self._stream[0])  # the hello
                reader, writer = self._stream
                writer.write(frame(request))
                reply = await read_frame(reader)
        except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self._close_stream()
            raise EngineError(f"engine server at {self.path}: {exc!r}") from None
        except asyncio.CancelledError:
            self._close_stream()  # its reply may still come: never read it as the next batch's
            raise
        return _result(reply)

    def _request(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple:
        """The ``infer`` message for one batch; raises EngineError for bad shapes."""
        check_batch(input_ids, attention_mask, self.max_batch_size, self.max_seq_len)
        return ("infer", np.ascontiguousarray(input_ids, dtype=np.int64),
                np.ascontiguousarray(attention_mask, dtype=np.int64))

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None

    def close(self) -> None:
        """Close the connections (idempotent); the server keeps running for the others."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._close_stream()


def _result(reply: tuple) -> np.ndarray:
    """The float32[B, D] of an ``("ok", rows)`` reply; raises EngineError with the server's message otherwise."""
    kind, value = reply
    if kind != "ok":
        raise EngineError(str(value))
    return value
