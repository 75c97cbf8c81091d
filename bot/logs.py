"""Logging: structlog JSON lines in production, a readable console in development.

ARCHITECTURE.md, "Operations": structured logs with a request id on every line and
personal data masked. :func:`configure_logging` sets up both structlog (our own
``structlog.get_logger(...)`` calls) and the standard library's root logger
(aiohttp, python-telegram-bot, httpx, asyncio), so every line leaving the
process goes through the same processors:

1. the context bound with :mod:`structlog.contextvars` (``request_id``, bound per
   HTTP request by bot/app.py's middleware and per message by the dispatcher);
2. level, logger name and an ISO-8601 UTC timestamp;
3. tracebacks rendered to text (``exception``), so they are masked too;
4. :class:`SecretScrubber`: values of secret-named keys (``token``, ``secret``,
   ``aes_key``, ``password``, ``authorization`` …) and every configured secret
   value wherever it appears in a string become ``***``;
5. :func:`mask_personal_data`: :func:`safety.pii.mask_pii` on every string value of
   the event, nested dicts, lists and tuples included (phone numbers, resident ID
   numbers, e-mails, street addresses → ``[PHONE]``, ``[ID]``, ``[EMAIL]``, ``[ADDRESS]``),
   except message ids (:data:`MESSAGE_ID_KEYS`: an 18-digit WeChat MsgId looks like
   an ID number, and a masked one can no longer be followed through the log);
6. :class:`structlog.processors.JSONRenderer` (one JSON object per line, UTF-8
   text unescaped) or :class:`structlog.dev.ConsoleRenderer`.

Standard-library lines also pass :class:`ClientErrorFilter` first: aiohttp's traceback
for a request it could not parse (a client's 4xx) becomes one warning line.

Format: ``json``, ``console``, or ``auto`` (console when the stream is a terminal,
JSON otherwise — containers and log shippers get JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import re
import secrets
import sys
import time
from typing import Any, Iterable, Iterator, TextIO

import structlog
from structlog.typing import EventDict, Processor

from safety.pii import mask_pii

__all__ = ["LOG_FORMATS", "REQUEST_ID_HEADER", "configure_logging", "config_secrets", "mask_personal_data",
           "SecretScrubber", "ClientErrorFilter", "new_request_id", "request_id_from_header", "ensure_request_id",
           "current_request_id", "logged_step"]

#: Accepted values of ``--log-format``.
LOG_FORMATS = ("auto", "json", "console")

#: HTTP header carrying the request id in and out (the de-facto standard name used by
#: load balancers and proxies such as Heroku's router and nginx's ``$request_id`` setups).
REQUEST_ID_HEADER = "X-Request-Id"

#: An incoming request id is kept only if it looks like one: 1–64 characters of
#: letters, digits and ``._:-`` (anything else could inject text into log lines).
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:\-]{1,64}")

#: Keys whose values are never logged: the last ``_``-separated part(s) of the key name.
_SECRET_KEY = re.compile(r"(?:^|_)(?:token|secret|password|passwd|aes_key|encoding_aes_key|api_key|apikey|"
                         r"authorization|cookie|credentials?)$", re.IGNORECASE)

#: Keys whose values are message or request ids, left unmasked when they look like an id
#: (:data:`_ID_VALUE`): ``message_id``, ``telegram_message_id``, ``msg_id``, ``msgid``, ``update_id``,
#: ``request_id``, any letter case.
MESSAGE_ID_KEYS = re.compile(r"(?:^|_)(?:message_id|msg_id|msgid|update_id|request_id)$", re.IGNORECASE)

#: An id as the channels make them (digits; ``chat:message``; ``openid:time:event``): no spaces, no
#: ``@``, at most 160 characters. Free text under an id key is masked like any other value.
_ID_VALUE = re.compile(r"[0-9A-Za-z_.:\-]{1,160}")

#: Configured secret values shorter than this (characters) are not searched for inside
#: other strings (a 3-letter token would blank out ordinary words); their keys still are.
MIN_SCRUBBED_SECRET_CHARS = 6

REDACTED = "***"


# ------------------------------------------------------------------ request ids


class _RequestIds:
    """Request ids unique across processes and restarts without a system call each: a random
    64-bit prefix per process (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix, self.counter = secrets.token_hex(8), itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter) & 0xFFFFFFFFFFFFFFFF:016x}"


#: A fresh request id: 32 lowercase hex characters (:class:`_RequestIds`).
new_request_id = _RequestIds()


def request_id_from_header(value: str | None) -> str:
    """The caller's ``X-Request-Id`` if it is well formed (1–64 of ``[A-Za-z0-9._:-]``), else a new id."""
    if value and _REQUEST_ID_OK.fullmatch(value):
        return value
    return new_request_id()


def current_request_id() -> str | None:
    """The request id bound in this context, if any."""
    return structlog.contextvars.get_contextvars().get("request_id")


@contextlib.contextmanager
def ensure_request_id() -> Iterator[str]:
    """Bind a new ``request_id`` for the block unless one is bound already (HTTP requests
    have one from the middleware; Telegram updates processed in the background and CLI
    questions get theirs here). Yields the id in effect."""
    rid = current_request_id()
    if rid:
        yield rid
        return
    rid = new_request_id()
    with structlog.contextvars.bound_contextvars(request_id=rid):
        yield rid


@contextlib.contextmanager
def logged_step(logger: Any, event: str, **fields: Any) -> Iterator[None]:
    """Progress of a long step: log ``<event>_started`` with ``fields`` (info), run the block,
    then ``<event>_done`` with ``fields`` and ``seconds`` (wall clock, 0.1 s). For the start-up
    work that takes minutes once and is cached afterwards (embedding the knowledge base,
    training the decision head). An exception leaves the block without a done line."""
    logger.info(f"{event}_started", **fields)
    started = time.monotonic()
    yield
    logger.info(f"{event}_done", seconds=round(time.monotonic() - started, 1), **fields)


# ------------------------------------------------------------------ processors


@functools.lru_cache(maxsize=1024)
def _is_id_key(key: str) -> bool:
    return bool(MESSAGE_ID_KEYS.search(key))


@functools.lru_cache(maxsize=1024)
def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


#: Values the processors themselves add (an ISO timestamp, the level name): never personal data or
#: secrets, so neither processor reads them (one regex pass fewer each, on every line).
_OWN_KEYS = frozenset({"timestamp", "level"})


def _is_message_id(key: Any, value: str) -> bool:
    return isinstance(key, str) and _is_id_key(key) and bool(_ID_VALUE.fullmatch(value))


def _mask(value: Any, key: Any = None) -> Any:
    if isinstance(value, str):
        return value if _is_message_id(key, value) else mask_pii(value)
    if isinstance(value, dict):
        return {k: _mask(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_mask(v) for v in value]
    return value


def mask_personal_data(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """structlog processor: :func:`safety.pii.mask_pii` on every string value, recursively
    (the event message included), except id-shaped values of :data:`MESSAGE_ID_KEYS`.
    Non-string scalars are left as they are (an int MsgId is never masked)."""
    for key, value in event_dict.items():
        if isinstance(value, (str, dict, list, tuple, set, frozenset)) and key not in _OWN_KEYS:
            event_dict[key] = _mask(value, key)
    return event_dict


class SecretScrubber:
    """structlog processor: secrets never reach a log line.

    Args:
        secrets: secret values (tokens, keys) to replace by ``***`` wherever they appear
            inside a string value; values shorter than :data:`MIN_SCRUBBED_SECRET_CHARS`
            characters are ignored here.

    Keys named like a secret (``token``, ``*_secret``, ``aes_key``, ``authorization`` …)
    get ``***`` whatever their value, at any nesting depth.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = sorted({s for s in secrets if s and len(s) >= MIN_SCRUBBED_SECRET_CHARS}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(v) for v in values)) if values else None

    def _scrub(self, key: Any, value: Any) -> Any:
        if isinstance(key, str) and _is_secret_key(key) and value not in (None, "", 0):
            return REDACTED
        if isinstance(value, str):
            return self._pattern.sub(REDACTED, value) if self._pattern is not None else value
        if isinstance(value, dict):
            return {k: self._scrub(k, v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._scrub(None, v) for v in value]
        return value

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> EventDict:
        for key, value in event_dict.items():
            if key not in _OWN_KEYS:
                event_dict[key] = self._scrub(key, value)
        return event_dict


class ClientErrorFilter(logging.Filter):
    """Standard-library filter: aiohttp's "Error handling request" for a request it could not
    parse (a 4xx the client caused: bytes not allowed in the URL, an oversized header line …)
    becomes one WARNING line naming the problem, without a traceback; aiohttp answers 400 itself.
    Tracebacks of real server errors (5xx, bugs) are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name == "aiohttp.server" and exc is not None:
            from aiohttp.http_exceptions import HttpProcessingError  # noqa: PLC0415 - only when needed

            if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
                first_line = str(exc.message or type(exc).__name__).strip().splitlines()[0:1]
                record.msg, record.args = "malformed HTTP request (%s %s): %s", (
                    exc.code, type(exc).__name__, first_line[0][:200] if first_line else "")
                record.levelno, record.levelname = logging.WARNING, "WARNING"
                record.exc_info, record.exc_text = None, None
        return True


def _add_logger_name(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


class _NamedPrintLogger(structlog.PrintLogger):
    """A :class:`structlog.PrintLogger` that remembers the name given to ``get_logger`` and writes
    each line, newline included, with one write.

    ``print`` writes the text and the newline apart; with ``PYTHONUNBUFFERED`` (a write-through
    stream) that is two ``write`` calls, and the front-end processes of ``serve --processes N``,
    which share one stderr, then put two JSON objects on one line now and then.
    """

    def __init__(self, file: TextIO, name: str = "") -> None:
        super().__init__(file)
        self.name = name

    def msg(self, message: str) -> None:
        with self._lock:
            self._file.write(message + "\n")
            self._file.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def config_secrets(cfg: Any) -> list[str]:
    """The secret values of a :class:`bot.config.Config`: every field that
    :func:`bot.config.redacted` replaces (WeChat token and AES key, Telegram token and secret)."""
    from bot.config import redacted  # noqa: PLC0415 - bot.config must not import logging set-up

    full, red = dataclasses.asdict(cfg), redacted(cfg)
    out = []
    for section, body in red.items():
        if isinstance(body, dict):
            out += [str(full[section][k]) for k, v in body.items() if v == REDACTED and full[section][k] != REDACTED]
    return out


def _shared_processors(secrets: Iterable[str]) -> list[Processor]:
    return [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        SecretScrubber(secrets),
        mask_personal_data,
    ]


def configure_logging(level: str = "INFO", fmt: str = "auto", secrets: Iterable[str] = (),
                      stream: TextIO | None = None) -> None:
    """Configure structlog and the standard library's root logger to write to ``stream``.

    Args:
        level: ``DEBUG`` | ``INFO`` | ``WARNING`` | ``ERROR`` (case-insensitive).
        fmt: ``json`` (one JSON object a line), ``console`` (human-readable, colours on
            a terminal) or ``auto`` (console if ``stream`` is a terminal, else JSON).
        secrets: secret values to scrub from every line (:func:`config_secrets`).
        stream: where lines go (default ``sys.stderr``).

    Raises:
        ValueError: unknown ``fmt`` or ``level``.
    """
    stream = sys.stderr if stream is None else stream
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(LOG_FORMATS)}")
    levelno = logging.getLevelName(level.upper())
    if not isinstance(levelno, int):
        raise ValueError(f"log level {level!r}: choose DEBUG, INFO, WARNING or ERROR")
    console = fmt == "console" or (fmt == "auto" and hasattr(stream, "isatty") and stream.isatty())
    secrets = list(secrets)
    renderer: Processor = (structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
                           if console else structlog.processors.JSONRenderer(ensure_ascii=False))
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, _add_logger_name, *_shared_processors(secrets),
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=lambda *args: _NamedPrintLogger(stream, str(args[0]) if args else ""),
        cache_logger_on_first_use=False,
    )
    # Standard-library loggers (aiohttp, telegram, httpx, asyncio): same processors, same stream.
    handler = logging.StreamHandler(stream)
    handler.addFilter(ClientErrorFilter())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_shared_processors(secrets),
                    renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(levelno)
