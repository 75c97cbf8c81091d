"""What every process the process pool starts (worker processes, engine servers) shares:
its configuration and logging from the parent's ``init`` message, ``"module:function"``
hooks, and the event loop it runs on."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import sys
from typing import Any, Callable

import structlog

from inference.config import InferenceConfig


def configure_child_logging(level: str = "INFO") -> None:
    """Logging of a child process whose parent named no ``log_setup``: structlog JSON lines
    on stderr (context variables, level, logger name, ISO-8601 UTC timestamp, traceback text),
    the standard library's root logger at ``level`` on stderr."""
    levelno = logging.getLevelName(level.upper())
    levelno = levelno if isinstance(levelno, int) else logging.INFO

    def logger_name(logger: Any, method: str, event_dict: dict) -> dict:
        name = getattr(logger, "name", None)
        if name:
            event_dict.setdefault("logger", name)
        return event_dict

    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, logger_name, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(ensure_ascii=False)],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(stream=sys.stderr, level=levelno, format="%(message)s", force=True)


def child_config(init: dict) -> InferenceConfig:
    """What a process started by the pool (worker or engine server) does first with its
    ``init``: set up logging (``init["log_setup"]``, a ``"module:function(level)"`` the
    parent was given, e.g. ``bot.logs:configure_logging``; else :func:`configure_child_logging`)
    at the parent's level with its label (``init["worker"]``) on every line,
    and rebuild its :class:`InferenceConfig` (keys this code does not know are ignored)."""
    setup = import_hook(init["log_setup"]) if init.get("log_setup") else configure_child_logging
    setup(init.get("log_level") or "INFO")
    structlog.contextvars.bind_contextvars(worker=init.get("worker"))  # which process each log line is from
    fields = {f.name for f in dataclasses.fields(InferenceConfig)}
    return InferenceConfig(**{k: v for k, v in init["cfg"].items() if k in fields})


def import_hook(spec: str) -> Any:
    """The function named by a ``"module:function"`` test or bench hook."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` for ``uvloop`` (and ``auto`` when installed), else None (asyncio's).

    Raises:
        ImportError: ``uvloop`` asked for but not installed.
    """
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def run_async(coro: Any, factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> Any:
    """``asyncio.run(coro)`` on a loop from ``factory`` (Python 3.11's ``asyncio.run``
    has no ``loop_factory``; ``asyncio.Runner`` does)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
