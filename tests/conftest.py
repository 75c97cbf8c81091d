"""Shared fixtures: the effective test config, and one real dispatcher (real model) per session."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator

import pytest
import structlog

from bot.config import REPO_ROOT, load_config

ENGINES = REPO_ROOT / "engines"


def model_ready() -> bool:
    """True when `healthbot prepare-model` has produced engines/manifest.json."""
    return (ENGINES / "manifest.json").exists()


requires_model = pytest.mark.skipif(not model_ready(), reason="engines/manifest.json missing: run 'make model'")

#: Seconds the one-off cache build may take: 7,200 KB texts and 9,300 decision lines embedded on 2 slow
#: cores took about 6 minutes in CI; a warm cache takes seconds.
WARM_UP_TIMEOUT_S = 1800


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the model's caches (engines/cache: KB vectors, topic prior, decision head, topic fit) before any test,
    with one ``healthbot ask``: on a fresh clone the first server a test starts would otherwise spend
    its start-up timeout building them (the order of the test files decides which one that is).
    ``make test`` builds them itself first and sets ``HEALTHBOT_TEST_CACHES_BUILT``."""
    if not model_ready() or session.config.option.collectonly or os.environ.get("HEALTHBOT_TEST_CACHES_BUILT"):
        return  # `make test` builds them before the suite
    with tempfile.TemporaryDirectory() as data:
        env = {**os.environ, "HEALTHBOT_DATA_DIR": data}
        done = subprocess.run([sys.executable, "-m", "bot.cli", "--log-level", "WARNING", "ask", "你好"], env=env,
                              cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=WARM_UP_TIMEOUT_S)
    if done.returncode != 0:
        raise pytest.UsageError(f"building the model's caches failed: {done.stderr[-3000:]}")


@contextmanager
def restored_logging() -> Iterator[None]:
    """Undo, on exit, what ``bot.logs.configure_logging`` changes: the structlog
    configuration and the root logger's handlers and level (a test's captured stream
    must not stay the process's log stream)."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        structlog.configure(**saved)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


@pytest.fixture
def cli_main():
    """bot.cli.main, with the logging configuration it installs (on the captured stderr) undone afterwards."""
    from bot.cli import main

    with restored_logging():
        yield main


@pytest.fixture(scope="session")
def cfg(tmp_path_factory):
    """Defaults, with a temporary data directory and test WeChat credentials."""
    data = tmp_path_factory.mktemp("data")
    return load_config(env={
        "HEALTHBOT_DATA_DIR": str(data),
        "HEALTHBOT_WECHAT_TOKEN": "testtoken",
        "HEALTHBOT_WECHAT_APPID": "wx1234567890abcdef",
    })


@pytest.fixture(scope="session")
async def dispatcher(cfg):
    """A real dispatcher: real ONNX model, inference pool, knowledge base and safety rules."""
    if not model_ready():
        pytest.skip("engines/manifest.json missing: run 'make model'")
    from bot.runtime import open_dispatcher
    async with open_dispatcher(cfg) as d:
        yield d
