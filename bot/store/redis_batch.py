"""Redis commands issued in one turn of the event loop go out as one pipeline.

A message makes about nine Redis round trips (docs/loadtest.md), and redis-py spends most of
a command's client CPU on its asyncio machinery, not on Redis: on a 2-core development machine
one ``GET`` costs the client about 100 µs sent alone, and 74, 44, 27 and 15 µs a command in a
pipeline of 1, 2, 4 and 16 (redis-py 8.2 with hiredis, measured 2026-12-04, twenty-first
session). Under load many messages are in flight in each process, and their commands become
ready in the same turn of the loop: :class:`CommandBatcher` sends them together.

- **No waiting.** With no pipeline in flight a command goes out at once, as a pipeline of one
  (cheaper in redis-py than a command alone). Otherwise the first command of a turn schedules
  the send for the end of that turn (``loop.call_soon``) and the others of the turn join it.
- **Not a transaction.** Each command is atomic on its own, as when sent alone; commands of
  different callers are not made atomic together. Scripts are sent with ``EVAL`` (Redis keeps
  the compiled script by its hash), so a pipeline never needs a ``SCRIPT LOAD`` first and a
  restarted Redis never answers ``NOSCRIPT``.
- **Errors stay with their caller.** A command's own error (``WRONGTYPE`` …) is raised to
  that caller alone; a connection error fails every command of the pipeline, as it would have
  failed each of them alone. A caller cancelled while waiting leaves the others untouched.
- **One deadline a pipeline.** The pool's connections have no socket timeout: redis-py would
  arm one for every reply it reads (an ``asyncio.timeout`` per command). The whole pipeline has
  ``timeout_s`` instead; when it passes, redis-py drops the connection it was reading (a
  cancelled read disconnects) and every command of the pipeline fails with ``TimeoutError``.
  Measured with tools/redis_store_bench.py, 16 messages in flight: 218-239 → 175-191 µs of
  client CPU a message (2026-12-05, twenty-fourth session).
- **The pipeline without redis-py's ``Pipeline.execute``.** redis-py builds each command's
  arguments (a ``Pipeline`` used only as a command list) and parses each reply through the
  client's own response callbacks (``Redis.parse_response``); the batcher writes the packed
  commands on a connection it keeps between pipelines (``Connection.send_packed_command``) and
  retries a dropped connection with the pool's ``Retry``, as ``Pipeline.execute`` does. What it
  leaves out is the pool's checkout and return a pipeline (a lock, a liveness read of the socket,
  telemetry) and the pipeline's bookkeeping: tools/redis_store_bench.py, one message in flight,
  670-691 → 509-511 µs of client CPU a message (2026-12-06, thirty-third session). A connection
  whose replies were left unread (a deadline, a cancelled caller) is dropped, never kept.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

__all__ = ["CommandBatcher"]

#: Adds one caller's commands to a pipeline.
Add = Callable[[Any], None]


class CommandBatcher:
    """Sends the commands submitted during one event-loop turn as one non-transactional pipeline.

    Args:
        client: a ``redis.asyncio.Redis`` whose connections have no socket timeout.
        timeout_s: seconds a pipeline may take, from asking the pool for a connection to the
            last reply.
    """

    def __init__(self, client: Any, timeout_s: float = 5.0) -> None:
        self._client = client
        self.timeout_s = timeout_s
        self._queue: list[tuple[Add, int, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()
        #: Connections taken from the client's pool and kept between pipelines: the pool's own
        #: checkout (a lock, a liveness read, telemetry) cost a third of a pipeline's client CPU.
        self._idle: list[Any] = []
        #: Pipelines being sent now.
        self.in_flight = 0
        #: Pipelines sent, and commands in them (``commands / pipelines``: the mean batch).
        self.pipelines = 0
        self.commands = 0

    async def run(self, add: Add, count: int = 1) -> list[Any]:
        """The replies to the ``count`` commands that ``add`` puts on a pipeline, in order; a reply
        is the exception Redis answered for that command (the caller raises it).

        With no pipeline in flight the commands go out at once, from this coroutine; otherwise
        they join the pipeline sent at the end of this loop turn.

        Raises:
            the connection's error when the pipeline could not be sent; ``redis.exceptions.TimeoutError``
            when it took longer than ``timeout_s``.
        """
        if not self.in_flight and not self._queue:
            return await self._execute([(add, count)])
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queue:
            loop.call_soon(self._send_queued)
        self._queue.append((add, count, future))
        return await future

    async def _execute(self, batch: list[tuple[Add, int]]) -> list[Any]:
        """Every reply of ``batch``'s commands, in order (one pipeline on one connection)."""
        pipe = self._client.pipeline(transaction=False)  # redis-py builds each command's arguments
        for add, _count in batch:
            add(pipe)
        commands = list(pipe.command_stack)
        self.in_flight += 1
        self.pipelines += 1
        self.commands += len(commands)
        conn = None
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = self._idle.pop() if self._idle else await self._client.connection_pool.get_connection()
                replies = await conn.retry.call_with_retry(lambda: self._round_trip(conn, commands),
                                                           lambda _error: conn.disconnect())
        except BaseException as e:
            if conn is not None:  # replies may be left unread on it: never reused
                await conn.disconnect(nowait=True)
                self._release(conn)
            if isinstance(e, TimeoutError):  # asyncio's, raised where the deadline cancelled the read
                raise RedisTimeoutError(f"no reply within {self.timeout_s:g} s") from e
            raise
        finally:
            self.in_flight -= 1
        self._idle.append(conn)
        return replies

    async def _round_trip(self, conn: Any, commands: list[tuple[tuple, dict]]) -> list[Any]:
        """Send ``commands`` (redis-py's ``(args, options)``) in one write and read their replies,
        each through the client's response callback; a command's error is its reply."""
        await conn.send_packed_command(conn.pack_commands([args for args, _options in commands]))
        replies: list[Any] = []
        for args, options in commands:
            try:
                replies.append(await self._client.parse_response(conn, args[0], **options))
            except ResponseError as e:
                replies.append(e)
        return replies

    def _release(self, conn: Any) -> None:
        """Give a dropped connection back to the pool (in the background: it never waits long)."""
        task = asyncio.get_running_loop().create_task(self._client.connection_pool.release(conn))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _send_queued(self) -> None:
        batch, self._queue = self._queue, []
        batch = [item for item in batch if not item[2].done()]  # callers cancelled meanwhile
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Add, int, asyncio.Future]]) -> None:
        try:
            replies = await self._execute([(add, count) for add, count, _future in batch])
        except BaseException as exc:  # noqa: BLE001 - handed to every caller
            cancelled = isinstance(exc, asyncio.CancelledError)
            for _add, _count, future in batch:
                if not future.done():
                    future.cancel() if cancelled else future.set_exception(exc)
            if cancelled:
                raise
            return
        at = 0
        for _add, count, future in batch:
            if not future.done():
                future.set_result(replies[at:at + count])
            at += count

    async def close(self) -> None:
        """Wait for the pipelines being sent, then give the kept connections back to the pool."""
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._client.connection_pool.release(conn)
