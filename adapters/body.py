"""Reading a webhook body with a size limit, shared by the channel adapters."""

from __future__ import annotations

from aiohttp import web


class BodyTooLarge(Exception):
    """The request body is over the limit (answer 413)."""


async def read_limited(request: web.Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; chunked bodies are counted as they arrive.

    Raises:
        BodyTooLarge: ``Content-Length`` or the bytes actually sent exceed ``limit``.
    """
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Content-Length {request.content_length} > {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body over {limit} bytes")
    return b"".join(chunks)
