"""Several front-end processes on one host (``healthbot serve --processes N``, bot/prefork.py and
bot/front_ends.py).

* In process: the process count (0 = one per core, minus one for a GPU engine server), ONNX Runtime
  threads per process, each process's GPU and engine server, and what is refused at start (a store
  inside one process, worker processes, Telegram polling, a port in use).
* The engine servers alone (``ProcessPoolEncoder.engine_servers``), on a GPU engine double that
  computes with the real model on the CPU (no GPU here).
* A real ``healthbot serve --processes 2`` on loopback (the real model, ONNX Runtime on the CPU):
  both processes answer ``/api/v1/chat``; ``/metrics`` is the sum over both; a process killed with
  SIGKILL is restarted while the other keeps answering; SIGTERM with questions in flight answers
  every one of them, and every process exits, status 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from bot.config import REPO_ROOT, load_config
from bot.prefork import check_config, front_end_count, front_end_threads
from tests.conftest import requires_model
from tests.servers import free_port

#: The batcher holds a batch open this long for company (inference.max_queue_delay_ms, idle dispatch
#: off, no embedding cache), so that questions are certainly in flight when SIGTERM arrives.
HOLD_MS = 2000
SHUTDOWN_TIMEOUT_S = 8.0
QUESTIONS = ["手脚冰凉怎么办", "失眠怎么调理", "how much water should I drink a day"]


# ------------------------------------------------------------------ in process


def test_auto_is_one_process_per_core_less_one_for_a_gpu_engine_server(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cfg = load_config(env={"HEALTHBOT_SERVER_PROCESSES": "0"})
    assert front_end_count(cfg, gpu=False) == 16 and front_end_count(cfg, gpu=True) == 15
    assert front_end_count(load_config(env={}), gpu=True) == 1  # the default: one process, as before
    assert front_end_count(load_config(env={"HEALTHBOT_SERVER_PROCESSES": "3"}), gpu=True) == 3
    # ONNX Runtime threads per process: 1-2 so that the sessions do not oversubscribe the cores
    assert [front_end_threads(cfg, n) for n in (15, 8, 4, 2)] == [1, 2, 2, 2]
    assert front_end_threads(load_config(env={"HEALTHBOT_INFERENCE_INTRA_OP_THREADS": "3"}), 15) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert front_end_count(cfg, gpu=True) == 1


def test_each_process_uses_its_gpus_engine_server_in_turn(tmp_path):
    from bot.front_ends import Master

    cfg = load_config(env={"HEALTHBOT_SERVER_PROCESSES": "3"})
    master = Master(cfg, 1, True, "INFO", "json", str(tmp_path))
    sockets = {0: "/run/a/cuda0.sock", 1: "/run/a/cuda1.sock"}
    got = [master._front_end_cfg(i, sockets).inference for i in range(3)]
    assert [(c.devices, c.engine_socket) for c in got] == [(["0"], sockets[0]), (["1"], sockets[1]),
                                                           (["0"], sockets[0])]
    assert {c.workers for c in got} == {4} and {c.intra_op_threads for c in got} == {1}
    cpu = master._front_end_cfg(0, {})
    assert cpu.inference.engine_socket == "" and cpu.server.processes == 3 and cfg.inference.intra_op_threads == 0


@pytest.mark.parametrize("env, args, message", [
    ({"HEALTHBOT_STORE_URL": "memory://"}, [], "keeps state inside one process"),
    ({"HEALTHBOT_STORE_URL": "sqlite:///:memory:"}, [], "keeps state inside one process"),
    ({"HEALTHBOT_INFERENCE_DEVICE_PROCESSES": "1"}, [], "choose one"),
    ({}, ["--telegram-polling"], "needs one process"),
])
def test_what_several_processes_cannot_share_is_refused_at_start(cli_main, capsys, monkeypatch, env, args, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli_main(["serve", "--processes", "2", *args]) == 2
    assert message in capsys.readouterr().err
    check_config(load_config(env={}))  # the SQLite default is shared: accepted


def test_a_port_in_use_stops_the_start_at_once(cli_main, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HEALTHBOT_DATA_DIR", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert cli_main(["serve", "--processes", "2", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


# ------------------------------------------------------------------ the engine servers alone


@requires_model
async def test_engine_servers_alone_serve_remote_engines_and_stop(monkeypatch):
    from inference.config import InferenceConfig
    from inference.engines.onnxruntime import OnnxRuntimeEngine
    from inference.engines.remote import RemoteEngine
    from inference.multiproc.router import ProcessPoolEncoder

    monkeypatch.setenv("HEALTHBOT_ASSUME_GPU", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                   os.environ.get("PYTHONPATH")])))
    cfg = InferenceConfig(engine_order=["torch_cuda", "onnxruntime"], onnx_precision="fp32")
    servers = await ProcessPoolEncoder.engine_servers(cfg, REPO_ROOT / "engines",
                                                      server_loader="worker_doubles:gpu_engine_double")
    try:
        assert servers.workers == [] and list(servers.servers) == [0] and servers.servers[0].alive
        ids, mask = np.array([[0, 5, 2]]), np.array([[1, 1, 1]])
        engine = await asyncio.to_thread(RemoteEngine, servers.servers[0].server_path, "torch_cuda", 5.0)
        out = await asyncio.to_thread(engine.infer, ids, mask)
        engine.close()
        local = OnnxRuntimeEngine(REPO_ROOT / "engines" / "model.onnx", intra_op_threads=1)
        np.testing.assert_allclose(out, local.infer(ids, mask), atol=1e-5)  # the model ran in the server
        local.close()
    finally:
        await servers.close()
    assert servers.servers[0].process.returncode is not None


# ------------------------------------------------------------------ a real master and two processes


class Group:
    """``healthbot serve --processes 2`` with JSON logs in a file."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        env = {**os.environ, "HEALTHBOT_DATA_DIR": str(tmp_path), "HEALTHBOT_WECHAT_TOKEN": "procs-token",
               "HEALTHBOT_WECHAT_APPID": "wx0123456789abcdef",
               "HEALTHBOT_SERVER_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_TIMEOUT_S),
               "HEALTHBOT_INFERENCE_MAX_QUEUE_DELAY_MS": str(HOLD_MS), "HEALTHBOT_INFERENCE_IDLE_DISPATCH": "false",
               "HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "0", "HEALTHBOT_INFERENCE_DEADLINE_MS": "20000",
               "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0"}
        env.pop("HEALTHBOT_CONFIG", None)
        with open(self.log, "w", encoding="utf-8") as out:  # a file: a full pipe would block the processes
            self.proc = subprocess.Popen([sys.executable, "-m", "bot.cli", "--log-format", "json", "serve",
                                          "--processes", "2", "--port", str(self.port)],
                                         cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=out)

    def events(self, name: str) -> list[dict]:
        lines = [json.loads(x) for x in self.log.read_text(encoding="utf-8").splitlines() if x.startswith("{")]
        return [e for e in lines if e.get("event") == name]

    async def wait_for(self, name: str, timeout_s: float = 300.0) -> list[dict]:
        """The ``name`` log lines once there is one (fails if the master exits or ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        while not (found := self.events(name)):
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {name} within {timeout_s} s: {self.log.read_text()[-3000:]}"
            await asyncio.sleep(0.2)
        return found

    def replies_by_pid(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for e in self.events("reply"):
            counts[e["pid"]] = counts.get(e["pid"], 0) + 1
        return counts

    async def ask(self, n: int, tag: str) -> list[tuple[int, dict]]:
        """``n`` questions at once, each on its own connection (the kernel spreads connections)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                         connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
            async def one(i: int) -> tuple[int, dict]:
                async with http.post(f"{self.base}/api/v1/chat", json={"text": QUESTIONS[i % len(QUESTIONS)],
                                                                        "user_id": f"{tag}-{i}"}) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(i) for i in range(n)))

    async def metric(self, name: str) -> float:
        async with aiohttp.ClientSession() as http, http.get(f"{self.base}/metrics") as r:
            page = await r.text()
        return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith(name))


def _answered(results: list[tuple[int, dict]]) -> bool:
    return all(status == 200 and body["intent"] == "answer" and body["reply"] for status, body in results)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@requires_model
async def test_two_processes_answer_share_metrics_survive_a_kill_and_drain_on_sigterm(tmp_path):
    group = Group(tmp_path)
    try:
        first = (await group.wait_for("processes.serving"))[0]["pids"]

        # Both processes answer; /metrics (whichever answers it) counts the questions of both.
        sent = 24
        assert _answered(await group.ask(sent, "a"))
        assert set(group.replies_by_pid()) == set(first)
        assert await group.metric('healthbot_request_latency_seconds_count{channel="http"') == sent

        # One is killed: the other answers meanwhile, and the master starts it again.
        os.kill(first[1], signal.SIGKILL)
        await group.wait_for("processes.process_exited")
        assert _answered(await group.ask(8, "b"))
        sent += 8
        new_pid = (await group.wait_for("processes.process_restarted"))[0]["pid"]
        assert new_pid not in first and group.events("processes.process_exited")[0]["exit_code"] == -signal.SIGKILL
        for round_ in range(5):  # until the new process has answered some (the kernel's hash decides)
            assert _answered(await group.ask(8, f"c{round_}"))
            sent += 8
            if new_pid in group.replies_by_pid():
                break
        assert new_pid in group.replies_by_pid()
        # the killed process's counts stay in the sum
        assert await group.metric('healthbot_request_latency_seconds_count{channel="http"') == sent
        assert await group.metric("healthbot_server_process_restarts_total") == 1

        # SIGTERM with questions in flight: every one is answered, every process exits, status 0.
        questions = asyncio.ensure_future(group.ask(12, "d"))
        deadline = time.monotonic() + HOLD_MS / 1000.0 * 0.8
        while await group.metric("healthbot_requests_in_flight") < 12 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await group.metric("healthbot_requests_in_flight") == 12, "not all in flight before SIGTERM"
        group.proc.send_signal(signal.SIGTERM)
        answers = await questions
        rc = await asyncio.to_thread(group.proc.wait, SHUTDOWN_TIMEOUT_S + 10)
    finally:
        if group.proc.poll() is None:
            group.proc.kill()
            group.proc.wait()
    assert _answered(answers), answers
    assert rc == 0
    survivors = [first[0], new_pid]
    assert not any(_alive(pid) for pid in survivors)
    assert {e["pid"] for e in group.events("shutdown_complete")} == set(survivors)
    assert not group.events("shutdown_timed_out")
    assert group.events("processes.shutdown_complete")[0]["level"] == "info"
    lines = [json.loads(x) for x in group.log.read_text(encoding="utf-8").splitlines() if x.startswith("{")]
    assert [e["event"] for e in lines if e.get("level") in ("error", "critical")] == ["processes.process_exited"]
