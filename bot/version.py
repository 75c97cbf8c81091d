"""The package's version, for ``healthbot --version`` (bot/cli.py).

From the installed distribution's metadata (``importlib.metadata``: what ``pip install``
recorded), else from ``pyproject.toml`` beside the package (a checkout run without an
install, ``python -m bot.cli``), else ``"unknown"``.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

__all__ = ["DISTRIBUTION", "package_version"]

DISTRIBUTION = "healthbot"
"""The distribution name in pyproject.toml's ``[project] name``."""

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version(pyproject: Path = _PYPROJECT) -> str:
    """The version string, e.g. ``"0.1.0"``: installed metadata first, then ``pyproject`` (its
    ``[project] version``), then ``"unknown"``. Never raises."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    try:
        version = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
    except (OSError, ValueError, KeyError, TypeError):  # missing, not TOML (a ValueError), no version
        return "unknown"
    return str(version)
