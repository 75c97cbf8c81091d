"""Installed as a package: a wheel built from this checkout, installed (not editable) into a
fresh virtual environment, serves from a folder outside the checkout, with its model and data
in the user data folder (bot/config.py ``base_dir``) and nothing written into site-packages;
the wheel carries every data file of the packages; constraints.txt pins what the Docker images
install.

The fresh environment reuses the test environment's installed dependencies (a ``.pth`` line
naming its site-packages, written after the wheel is installed, so pip never sees the checkout's
editable healthbot), so the test needs no index and installs nothing else."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bot.config import REPO_ROOT
from tests.conftest import ENGINES, requires_model
from tests.servers import ServeProcess

PACKAGES = ("bot", "adapters", "inference", "safety")
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The healthbot wheel, built offline (``pip wheel --no-build-isolation``) from a copy of the
    checkout's distribution files (the build's ``build/`` and ``*.egg-info`` stay out of the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = dist.glob("healthbot-*.whl")
    return built


def test_the_wheel_carries_every_data_file_of_the_packages(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    data = sorted(str(p.relative_to(REPO_ROOT)) for name in PACKAGES for p in (REPO_ROOT / name).rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)
    assert "bot/kb/sleep.yaml" in data and "adapters/openapi.json" in data
    assert [f for f in data if f not in names] == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_constraints_pin_every_requirement_the_docker_images_install():
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    reqs = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["prepare"]]
    for req in reqs:  # every requirement pinned, at a version pyproject.toml allows
        assert req.specifier.contains(pins.get(canonicalize_name(req.name), "missing"), prereleases=True), req
    for dockerfile in (REPO_ROOT / "Dockerfile", REPO_ROOT / "deploy" / "Dockerfile.gpu"):
        text = dockerfile.read_text(encoding="utf-8")
        assert "COPY pyproject.toml README.md LICENSE constraints.txt ./" in text
        assert re.search(r"pip install -c constraints\.txt '\.\[[a-z,]*prepare\]'", text), dockerfile


def _link_engines(to: Path) -> None:
    """The checkout's prepared model as links in ``to`` (a real folder, as is ``to/cache``): the
    server reads through them, and anything it writes lands in the folders, never in the originals."""
    (to / "cache").mkdir(parents=True)
    for folder in (ENGINES, ENGINES / "cache"):
        for f in folder.iterdir():
            if f.is_file() and f.name != "README.md":
                (to / f.relative_to(ENGINES)).symlink_to(f.resolve())


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix != ".pyc"}


@requires_model
def test_a_wheel_installed_in_a_fresh_venv_serves_from_any_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (packages,) = (venv / "lib").glob("python3*/site-packages")
    (packages / "healthbot-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n", encoding="utf-8")
    installed = _files(packages)

    work, xdg = tmp_path / "work", tmp_path / "xdg"  # a folder outside the checkout; the user data folder
    work.mkdir()
    _link_engines(xdg / "healthbot" / "engines")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHBOT_") and k != "PYTHONPATH"}
    env["XDG_DATA_HOME"] = str(xdg)
    where = subprocess.run([str(py), "-c", "import bot; print(bot.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert Path(where).is_relative_to(packages)  # the wheel's code, not the checkout's
    version = subprocess.run([str(venv / "bin" / "healthbot"), "--version"], cwd=work, env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert version.strip() == f"healthbot {PROJECT['version']}"

    server = ServeProcess(env, tmp_path / "serve.log", "installed healthbot", command=[str(venv / "bin" / "healthbot")],
                          cwd=work)
    try:
        server.wait_ready(timeout_s=600)  # seconds with engines/cache current; a first start trains for minutes
        req = urllib.request.Request(server.base + "/api/v1/chat", data=json.dumps({"text": "失眠怎么调理"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            reply = json.loads(resp.read())
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert reply["intent"] == "answer" and reply["topic"].startswith("sleep.") and "失眠" in reply["reply"]
    log = server.log.read_text(encoding="utf-8")
    assert f"model in {xdg / 'healthbot' / 'engines'}" in log
    assert f"healthbot ready: http://127.0.0.1:{server.port} (POST /api/v1/chat" in log
    assert (xdg / "healthbot" / "data" / "healthbot.db").is_file()  # the default data folder
    assert _files(packages) == installed  # nothing written into site-packages
    assert list(work.iterdir()) == []  # nor into the folder it ran in
