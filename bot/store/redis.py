"""The shared :class:`~bot.store.base.Store` for several replicas: Redis via ``redis.asyncio``.

``redis://[:password@]host:port/db``, ``rediss://…`` (TLS) or
``unix:///path/redis.sock?db=0``; query options of redis-py (``socket_timeout``,
``max_connections``, …) override the defaults here. Needs Redis ≥ 5 (``TIME`` in
scripts) and the ``redis`` extra (``pip install 'healthbot[redis]'``).

Atomicity, per the Redis docs:

* claims are one ``SET key value NX PX ms`` (https://redis.io/docs/latest/commands/set/):
  of any number of concurrent callers exactly one gets OK;
* compare-and-delete, the token bucket, push (type check + ``RPUSH`` + ``PEXPIRE``)
  and pop_all (``LRANGE`` + ``DEL``) are Lua scripts (sent with ``EVAL``): "Redis guarantees the
  script's atomic execution … no other script or Redis command will be executed
  while a script is executing" (https://redis.io/docs/latest/develop/interactive/programmability/eval-intro/);
* the token bucket reads the server's clock (``TIME``), so replicas with skewed
  clocks still share one refill rate.

Token buckets are hashes under :data:`BUCKET_PREFIX` + key (their own key space,
as in :class:`~bot.store.memory.MemoryStore`); each expires once it would be full
again, which is the same as absent. TTLs are rounded up to whole milliseconds.

The commands of all the messages in flight that become ready in one turn of the event loop are
sent as one pipeline (bot/store/redis_batch.py): each is atomic on its own, as alone.

When Redis stops answering (issue 21) callers go on without it (bot/store/health.py).
So that each message does not wait for every one of its store calls to fail in turn,
a call that could not reach Redis makes the following calls fail at once, without
trying, for :data:`RETRY_AFTER_S`; then the next call tries again. :meth:`RedisStore.health`
(``/readyz``) always tries. Keep the handoff state across a Redis restart with
persistence: ``appendonly yes`` (README, "Scaling out").
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from bot.store.base import Bucket, ClaimRead, StoreError
from bot.store.health import OK, PROBE_KEY, UNREACHABLE, UNWRITABLE
from bot.store.redis_batch import CommandBatcher

try:
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError, TimeoutError
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise StoreError(
        f"the Redis store needs redis-py ({e}): pip install 'healthbot[redis]', "
        "or unset HEALTHBOT_STORE_URL to use the embedded SQLite store"
    ) from e

#: After a call could not reach Redis, calls fail at once for this long before one tries again, seconds.
RETRY_AFTER_S = 1.0

#: Prefix of the Redis keys that hold token buckets (``take_token("x")`` → ``_bucket:x``).
BUCKET_PREFIX = "_bucket:"

_DELETE_IF_EQUAL = """
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1] bucket; ARGV rate (tokens/s), burst (tokens). State: tokens, ts (server time, s). With KEYS[2]
# and ARGV[3] (a claim's record, bot/store/base.py): no token unless KEYS[2] holds ARGV[3].
_TAKE_TOKEN = """
if #KEYS > 1 and (redis.call('TYPE', KEYS[2]).ok ~= 'string' or redis.call('GET', KEYS[2]) ~= ARGV[3]) then return 0 end
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
else
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  tokens = math.min(burst, tokens + elapsed * rate)
end
local took = 0
if tokens >= 1 then
  tokens = tokens - 1
  took = 1
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now))
if rate > 0 then
  redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
else
  redis.call('PERSIST', KEYS[1])
end
return took
"""

# KEYS[1] list; ARGV value, ttl in ms ('' = no expiry). A string at the key is replaced.
_PUSH = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'list' and kind ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('RPUSH', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('PERSIST', KEYS[1])
end
return 1
"""

_POP_ALL = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then return {} end
local items = {}
if kind == 'list' then items = redis.call('LRANGE', KEYS[1], 0, -1) end
redis.call('DEL', KEYS[1])
return items
"""

# KEYS[1] the claim, then ARGV[5] string keys, then list keys, then the record's key if ARGV[6] is '1';
# ARGV value, its PX ms, the value and PX if a read finds something ('' = no expiry), the number of string
# keys, whether there is a record, its value and PX. A key of another type reads as absent (as in get_many
# and read_all). The record, the reads and the choice of value are atomic with the claim; a record key
# holding another value (or a list) stops the script before any read: {0, {}, {}, 1}.
_CLAIM_AND_READ = """
local n = tonumber(ARGV[5])
local last = #KEYS
if ARGV[6] == '1' then
  local rk = KEYS[last]
  last = last - 1
  local ok
  if ARGV[8] == '' then ok = redis.call('SET', rk, ARGV[7], 'NX') else ok = redis.call('SET', rk, ARGV[7], 'NX', 'PX', ARGV[8]) end
  if not ok and (redis.call('TYPE', rk).ok ~= 'string' or redis.call('GET', rk) ~= ARGV[7]) then return {0, {}, {}, 1} end
end
local found = false
local strings = {}
for i = 1, n do
  local v = false
  if redis.call('TYPE', KEYS[1 + i]).ok == 'string' then v = redis.call('GET', KEYS[1 + i]) end
  if v then found = true end
  strings[i] = v
end
local lists = {}
for i = n + 2, last do
  local items = {}
  if redis.call('TYPE', KEYS[i]).ok == 'list' then items = redis.call('LRANGE', KEYS[i], 0, -1) end
  if #items > 0 then found = true end
  lists[#lists + 1] = items
end
local value, px = ARGV[1], ARGV[2]
if found then value, px = ARGV[3], ARGV[4] end
local ok
if px == '' then ok = redis.call('SET', KEYS[1], value, 'NX') else ok = redis.call('SET', KEYS[1], value, 'NX', 'PX', px) end
if ok then return {1, strings, lists} end
return {0, strings, lists}
"""

_FALLBACK = ("or unset HEALTHBOT_STORE_URL to use the embedded SQLite store under the data directory "
             "(one process only)")


def _ms(ttl_s: float) -> int:
    """Seconds → whole milliseconds for PX/PEXPIRE, at least 1 (Redis rejects 0)."""
    return max(1, math.ceil(ttl_s * 1000 - 1e-6))


def _px(ttl_s: float | None) -> int | str:
    """A script's PX argument: whole milliseconds, or '' for no expiry."""
    return "" if ttl_s is None else _ms(ttl_s)


def _take_token_on(pipe: Any, key: str, rate_per_s: float, burst: int,
                   record: tuple[str, str, float | None] | None = None) -> None:
    """Puts :data:`_TAKE_TOKEN` for the bucket at ``key`` on ``pipe``; with ``record`` (``key, value, ttl_s``)
    no token is taken unless the record's key holds its value."""
    if record is None:
        pipe.eval(_TAKE_TOKEN, 1, BUCKET_PREFIX + key, repr(float(rate_per_s)), int(burst))
    else:
        pipe.eval(_TAKE_TOKEN, 2, BUCKET_PREFIX + key, record[0], repr(float(rate_per_s)), int(burst), record[1])


def redacted_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisStore:
    """The :class:`~bot.store.base.Store` protocol on Redis (see the module docstring).

    One client with a blocking connection pool (callers wait for a free connection
    instead of failing). Connection errors are retried twice with backoff (a
    restarted Redis leaves dead pooled connections); then every method except
    :meth:`ping` raises :class:`StoreError` saying where Redis was expected.
    """

    def __init__(self, client: Redis, pool: BlockingConnectionPool, url: str, timeout_s: float = 5.0) -> None:
        self._client = client
        self._pool = pool
        self.url = redacted_url(url)
        kw = pool.connection_kwargs
        self.address = kw["path"] if kw.get("path") else f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        self.db = int(kw.get("db") or 0)
        #: Commands of one event-loop turn share a pipeline (bot/store/redis_batch.py).
        self.batcher = CommandBatcher(client, timeout_s)
        #: Monotonic time until which calls fail without trying (Redis did not answer).
        self._down_until = 0.0
        self._down_reason = ""

    @classmethod
    async def open(cls, url: str, *, connect_timeout_s: float = 2.0, timeout_s: float = 5.0,
                   max_connections: int = 64) -> "RedisStore":
        """Connect to ``url`` and PING it.

        Args:
            url: ``redis://host:port/db``, ``rediss://…`` or ``unix:///path.sock?db=N``.
            connect_timeout_s: seconds to wait for a TCP connection.
            timeout_s: seconds a round trip may take, waiting for a free pooled connection included.
            max_connections: pool size; further callers wait up to ``timeout_s``.

        Raises:
            StoreError: a malformed URL, or Redis unreachable / refusing the password,
                with the address and what to do.
        """
        try:
            pool = BlockingConnectionPool.from_url(
                url, decode_responses=True, max_connections=max_connections, timeout=timeout_s,
                socket_connect_timeout=connect_timeout_s, socket_timeout=None,  # the batcher's deadline instead
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2), retry_on_error=[ConnectionError],
                health_check_interval=30,
            )
        except (ValueError, TypeError) as e:
            raise StoreError(
                f"bad Redis URL {redacted_url(url)}: {e}: use redis://host:6379/0, rediss://… "
                "or unix:///path/redis.sock?db=0"
            ) from e
        store = cls(Redis(connection_pool=pool), pool, url, timeout_s)
        try:
            await store._send(lambda p: p.ping())
        except BaseException:
            await store.close()
            raise
        return store

    def _unreachable(self, e: BaseException) -> StoreError:
        where = f"Redis at {self.address} (db {self.db}, {self.url})"
        reason = str(e).rstrip(". ") or type(e).__name__
        if isinstance(e, AuthenticationError) or "NOAUTH" in reason or "WRONGPASS" in reason:
            return StoreError(f"{where} refused the password ({reason}). Put it in the URL as "
                              f"redis://:PASSWORD@host:port/db, {_FALLBACK}")
        port = self.address.rpartition(":")[2] if ":" in self.address else "6379"
        return StoreError(f"cannot reach {where}: {reason}. Start Redis there (e.g. 'redis-server "
                          f"--port {port}'), fix HEALTHBOT_STORE_URL, {_FALLBACK}")

    async def _call(self, awaitable, *, probe: bool = False):
        """Await a redis-py call, turning its errors into :class:`StoreError`.

        Within :data:`RETRY_AFTER_S` of a call that could not reach Redis, fails at once
        without trying, unless ``probe`` (health checks always try).
        """
        if not probe and time.monotonic() < self._down_until:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()  # the coroutine is never awaited
            raise StoreError(f"cannot reach Redis at {self.address} (db {self.db}, {self.url}): {self._down_reason} "
                             f"(not retried for {RETRY_AFTER_S:g} s)")
        try:
            result = await awaitable
        except (ConnectionError, TimeoutError, OSError) as e:
            error = self._unreachable(e)
            self._down_until = time.monotonic() + RETRY_AFTER_S
            self._down_reason = str(e).rstrip(". ") or type(e).__name__
            raise error from e
        except RedisError as e:
            raise self._error(e) from e
        self._down_until = 0.0
        return result

    def _error(self, e: RedisError) -> StoreError:
        return StoreError(f"Redis at {self.address} (db {self.db}): {e}")

    async def _send(self, add: Callable[[Any], None], count: int = 1, *, probe: bool = False) -> list[Any]:
        """The replies to the ``count`` commands ``add`` puts on the loop turn's pipeline
        (:class:`~bot.store.redis_batch.CommandBatcher`); a command's own error is raised."""
        replies = await self._call(self.batcher.run(add, count), probe=probe)
        for reply in replies:
            if isinstance(reply, RedisError):
                raise self._error(reply) from reply
        return replies

    async def _script(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One Lua script, sent with ``EVAL`` (see bot/store/redis_batch.py)."""
        return (await self._send(lambda p: p.eval(script, len(keys), *keys, *args)))[0]

    async def get(self, key: str) -> str | None:
        """The string at ``key``, or None if absent, expired or not a string (a list)."""
        try:
            return (await self._send(lambda p: p.get(key)))[0]
        except StoreError as e:
            if isinstance(e.__cause__, ResponseError) and "WRONGTYPE" in str(e.__cause__):
                return None
            raise

    async def get_many(self, keys: Sequence[str]) -> list[str | None]:
        """``MGET``: the strings at ``keys``, in order (None where absent or not a string)."""
        if not keys:
            return []
        return list((await self._send(lambda p: p.mget(list(keys))))[0])

    async def set_many(self, items: Sequence[tuple[str, str, float | None]]) -> None:
        """One ``SET key value [PX ms]`` per item, sent as one pipeline (one round trip; not a transaction)."""
        if not items:
            return
        def add(pipe: Any) -> None:
            for key, value, ttl_s in items:
                pipe.set(key, value, px=None if ttl_s is None else _ms(ttl_s))
        await self._send(add, len(items))

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """``SET key value [PX ms]``: replaces any value (a list too); expires after ``ttl_s`` seconds."""
        await self._send(lambda p: p.set(key, value, px=None if ttl_s is None else _ms(ttl_s)))

    async def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        """Claim ``key`` with ``SET key value NX [PX ms]``; True for exactly one concurrent caller."""
        return bool((await self._send(lambda p: p.set(key, value, nx=True, px=None if ttl_s is None else _ms(ttl_s))))[0])

    async def claim_and_read(self, key: str, value: str, ttl_s: float | None = None, strings: Sequence[str] = (),
                             lists: Sequence[str] = (), bucket: Bucket | None = None,
                             if_found: tuple[str, float | None] | None = None,
                             record: tuple[str, str, float | None] | None = None) -> ClaimRead:
        """One script (:data:`_CLAIM_AND_READ`: the record, the reads, then ``SET key value NX [PX ms]``,
        or ``if_found``'s value when a read found something), and the token bucket's script, in one
        pipeline; the bucket's script takes no token where the record's key holds another value."""
        keys = [key, *strings, *lists, *((record[0],) if record else ())]
        other, other_ttl_s = if_found or (value, ttl_s)
        kept = ("1", record[1], _px(record[2])) if record else ("", "", "")

        def add(pipe: Any) -> None:
            pipe.eval(_CLAIM_AND_READ, len(keys), *keys, value, _px(ttl_s), other, _px(other_ttl_s), len(strings), *kept)
            if bucket is not None:
                _take_token_on(pipe, *bucket, record=record)
        replies = await self._send(add, 1 + (bucket is not None))
        claimed, found, read, *conflict = replies[0]
        if conflict:
            return ClaimRead(False, [None] * len(strings), [[] for _ in lists], None, conflict=True)
        return ClaimRead(bool(claimed), list(found), [list(items) for items in read],
                         None if bucket is None else bool(replies[1]))

    async def delete(self, key: str) -> None:
        """``DEL key`` (no error if absent; buckets are kept)."""
        await self._send(lambda p: p.delete(key))

    async def delete_if_equal(self, key: str, value: str) -> bool:
        """Compare-and-delete in one Lua script (lock release); True if removed."""
        return bool(await self._script(_DELETE_IF_EQUAL, [key], [value]))

    async def take_token(self, key: str, rate_per_s: float, burst: int) -> bool:
        """Token bucket in one Lua script: capacity ``burst``, refilled at ``rate_per_s`` tokens/s.

        Uses the Redis server's clock. A bucket never seen (or expired because it
        was full again) starts full. Returns True if a token was taken.
        """
        return bool((await self._send(lambda p: _take_token_on(p, key, rate_per_s, burst)))[0])

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """``RPUSH`` + ``PEXPIRE`` (or ``PERSIST``) in one Lua script; a string at ``key`` is replaced."""
        await self._script(_PUSH, [key], [value, "" if ttl_s is None else _ms(ttl_s)])

    async def pop_all(self, key: str) -> list[str]:
        """``LRANGE 0 -1`` + ``DEL`` in one Lua script: the list, oldest first ([] if none)."""
        return list(await self._script(_POP_ALL, [key], []))

    async def read_all(self, key: str) -> list[str]:
        """``LRANGE 0 -1``: the list, oldest first, left in place ([] if none or not a list)."""
        try:
            return list((await self._send(lambda p: p.lrange(key, 0, -1)))[0])
        except StoreError as e:
            if isinstance(e.__cause__, ResponseError) and "WRONGTYPE" in str(e.__cause__):
                return []
            raise

    async def ping(self) -> bool:
        """True if Redis answers PING (False when unreachable; never raises)."""
        try:
            return bool(await self._send(lambda p: p.ping(), probe=True))
        except StoreError:
            return False

    async def health(self) -> str:
        """For ``/readyz``: ``"ok"`` when PING and a small write (:data:`~bot.store.health.PROBE_KEY`,
        expiring after a minute) succeed, ``"unwritable"`` when Redis answers but refuses the
        write (``MISCONF`` after a failed save on a full disk, ``OOM``, ``READONLY`` replica),
        ``"unreachable"`` otherwise. Always tries, even within :data:`RETRY_AFTER_S` of a failure;
        a success lets the other calls try again at once. Never raises."""
        try:
            await self._send(lambda p: p.ping(), probe=True)
        except StoreError:
            return UNREACHABLE
        try:
            await self._send(lambda p: p.set(PROBE_KEY, repr(time.time()), px=60_000), probe=True)
        except StoreError:
            return UNWRITABLE
        return OK

    async def close(self) -> None:
        """Close the client and every pooled connection; safe to call twice."""
        await self.batcher.close()
        close = getattr(self._client, "aclose", None) or self._client.close
        await close()
        await self._pool.disconnect()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"
