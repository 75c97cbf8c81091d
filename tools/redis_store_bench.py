"""Client CPU of the Redis store per simulated message (docs/loadtest.md, "Redis commands of one
loop turn in one pipeline").

    python tools/redis_store_bench.py redis://127.0.0.1:6379/15 [--in-flight 1,16] [--messages 2000]

Each "message" makes the store calls of a real one, one after another: ``get_many`` of four keys,
``set_if_absent`` (the claim), ``take_token`` (the rate limit), ``set_many`` of three keys (the
reply, session and transcript), ``pop_all`` (the WeChat pending answers). ``--in-flight`` messages
run at once. Prints the process's CPU per message (``time.process_time``, the client only: Redis
runs in its own process) and messages a second. Writes keys under ``bench:`` in the given database.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bot.store import open_store  # noqa: E402


async def _message(store, i: int) -> None:
    await store.get_many([f"bench:reply:{i}", "bench:handoff", "bench:session", "bench:turns"])
    await store.set_if_absent(f"bench:dedup:{i}", "1", 30.0)
    await store.take_token(f"bench:rate:{i % 50}", 1.0, 8)
    await store.set_many([(f"bench:reply:{i}", "x" * 300, 60.0), ("bench:session", "y" * 100, 60.0),
                          ("bench:turns", "z" * 200, 60.0)])
    await store.pop_all(f"bench:pending:{i % 50}")


async def main(url: str, in_flight: list[int], messages: int) -> None:
    store = await open_store(url)
    try:
        for n in in_flight:
            gate = asyncio.Semaphore(n)

            async def one(i: int) -> None:
                async with gate:
                    await _message(store, i)

            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.gather(*(one(n * 1_000_000 + i) for i in range(messages)))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"in flight {n}: {cpu / messages * 1e6:.0f} µs of client CPU a message, {messages / wall:.0f} messages/s")
    finally:
        await store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--in-flight", default="1,16")
    p.add_argument("--messages", type=int, default=2000)
    a = p.parse_args()
    asyncio.run(main(a.url, [int(x) for x in a.in_flight.split(",")], a.messages))
