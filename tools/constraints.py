"""Write ``constraints.txt``: the exact versions the Docker images install.

Every distribution that ``healthbot[prepare,gpu,redis]`` needs (its requirements in
``pyproject.toml``, then theirs from the installed metadata, ``importlib.metadata``),
pinned at the version installed in the running environment (``.venv``, where the test
suite passed);
a local version label (``torch 2.13.0+cpu``) is dropped so that the pin matches the CPU
and the CUDA builds alike. Distributions not installed here (``cuda-python``) stay unpinned.

Usage, after ``make test`` passed: ``.venv/bin/python tools/constraints.py > constraints.txt``
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: The extras the Docker images install (Dockerfile: prepare; deploy/Dockerfile.gpu: gpu, prepare)
#: and the Redis client of the Kubernetes variants.
EXTRAS = ("prepare", "gpu", "redis")
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

HEADER = """\
# Versions the Docker images install (pip install -c constraints.txt): healthbot[{extras}]
# and everything it needs, as installed where the test suite passed.
# Regenerate with: .venv/bin/python tools/constraints.py > constraints.txt
"""


def pinned(extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """``{distribution name: version}`` of the closure of pyproject.toml's dependencies and those
    of ``extras``, versions without their local label; distributions not installed are left out."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    roots = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    seen: set[tuple[str, frozenset[str]]] = set()
    out: dict[str, str] = {}
    todo = [(Requirement(r).name, frozenset(Requirement(r).extras)) for r in roots]
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out[dist.metadata["Name"]] = dist.version.split("+")[0]
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return out


def main() -> int:
    """Print the constraints file to stdout."""
    sys.stdout.write(HEADER.format(extras=",".join(EXTRAS)))
    for name, version in sorted(pinned().items(), key=lambda kv: canonicalize_name(kv[0])):
        sys.stdout.write(f"{name}=={version}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
