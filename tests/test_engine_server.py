"""Engine server (inference/multiproc/engine_server.py) and its client engine (inference/engines/remote.py).

The server loop runs over the real ONNX model on real Unix sockets, first on a
thread of this process, then as the process pool starts it (real processes, a
GPU engine double that computes with the real model on the CPU: no GPU here).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bot.config import Config, ConfigError, InferenceConfig, load_config
from inference.batcher import DeadlineExceeded
from inference.encoder import Encoder
from inference.batching.merge import merge, merge_plan
from inference.multiproc.engine_server import EngineServer
from inference.engines.base import EngineError
from inference.engines.remote import RemoteEngine
from inference.batching.windows import pad_batch
from inference.multiproc.router import ProcessPoolEncoder
from inference.tokenizer import E5Tokenizer
from tests.worker_doubles import GpuEngineDouble

ENGINES_DIR = Config().engines_path
needs_model = pytest.mark.skipif(not (ENGINES_DIR / "manifest.json").is_file(),
                                 reason="run 'healthbot prepare-model' first (CI does)")
DOUBLES = str(Path(__file__).parent)
QUESTIONS = ["失眠怎么调理", "手脚冰凉怎么办", "how much water should I drink a day", "高血压的人早餐吃什么好",
             "老人膝盖疼能不能爬山", "孩子发烧38度5要不要去医院", "what foods are high in iron", "晚上总是睡不着"]


# ------------------------------------------------------------------ merging

def test_merge_plan_joins_batches_within_the_row_token_and_padding_limits():
    shapes = [(20, 27), (30, 12), (40, 31), (100, 20), (200, 29), (10, 300)]
    # 190 rows x 31 tokens fit 256 rows / 8192 tokens and waste < 2x; +200 rows do not fit;
    # 10 x 300 would pad the others to 300 tokens: it runs alone.
    assert merge_plan(shapes, 256, 8192) == [[0, 1, 2, 3], [4], [5]]
    assert merge_plan(shapes, 256, 2000) == [[0, 1], [2], [3], [4], [5]]
    assert merge_plan(shapes, 1, 8192) == [[0], [1], [2], [3], [4], [5]]
    # 9 x 512 = 4,608 tokens is within the budget but 6x the 728 tokens of running them apart.
    assert merge_plan([(8, 27), (1, 512)], 256, 8192) == [[0], [1]]


def test_merge_pads_added_columns_with_a_zero_mask():
    a = (np.array([[0, 5, 2]]), np.array([[1, 1, 1]]))
    b = (np.array([[0, 7, 8, 9, 2], [0, 6, 2, 1, 1]]), np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    ids, mask = merge([a, b])
    assert ids.tolist() == [[0, 5, 2, 0, 0], [0, 7, 8, 9, 2], [0, 6, 2, 1, 1]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_engine_server_setting_takes_true_or_false_and_refuses_a_typo():
    assert InferenceConfig().engine_server is True
    assert load_config(env={"HEALTHBOT_INFERENCE_ENGINE_SERVER": "false"}).inference.engine_server is False
    assert load_config(env={"HEALTHBOT_INFERENCE_ENGINE_SERVER": "On"}).inference.engine_server is True
    with pytest.raises(ConfigError, match="inference.engine_server.*'nope'"):
        load_config(env={"HEALTHBOT_INFERENCE_ENGINE_SERVER": "nope"})


# ------------------------------------------------------------------ the server loop on a thread

class _SlowFirst:
    """Wraps an engine: the first batch takes 0.3 s, so the batches sent meanwhile wait together."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, 0
        self.name, self.dim = engine.name, engine.dim
        self.max_batch_size, self.max_seq_len = engine.max_batch_size, engine.max_seq_len

    def infer(self, ids, mask):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.3)
        if (ids == 666).any():
            raise EngineError("device lost")
        return self.engine.infer(ids, mask)

    def close(self) -> None:
        self.engine.close()


class _Running:
    def __init__(self, tmp_path: Path, *engines) -> None:
        engine = engines[0]
        self.path = str(tmp_path / "s.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.control, self._parent = socket.socketpair()
        info = {"name": engine.name, "dim": engine.dim, "max_batch_size": engine.max_batch_size,
                "max_seq_len": engine.max_seq_len, "precision": "fp32", "gpu_memory_bytes": 5, "device": 0}
        self.server = EngineServer(engines, self.listener, self.control, 256, 8192, info)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._parent.close()  # end of file on the control socket stops the server
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def tokenizer():
    return E5Tokenizer.load(ENGINES_DIR)


@needs_model
def test_batches_sent_while_the_engine_is_busy_run_as_one_and_each_gets_its_own_rows(tmp_path, tokenizer):
    engine = GpuEngineDouble(ENGINES_DIR)
    running = _Running(tmp_path, _SlowFirst(engine))
    try:
        # Four workers' batches: 2 + 1 + 3 + 2 questions of different lengths.
        parts = [QUESTIONS[0:2], QUESTIONS[2:3], QUESTIONS[3:6], QUESTIONS[6:8]]
        batches = [pad_batch([w for ws in tokenizer.encode_batch(p, "query: ") for w in ws], tokenizer.pad_id)
                   for p in parts]
        want = [engine.infer(ids, mask) for ids, mask in batches]
        engine.batch_rows.clear()
        clients = [RemoteEngine(running.path, "torch_cuda", timeout_s=10) for _ in parts]
        assert (clients[0].dim, clients[0].precision, clients[0].gpu_memory_bytes) == (384, "fp32", 5)
        got: dict[int, np.ndarray] = {}
        first = threading.Thread(target=lambda: got.__setitem__(0, clients[0].infer(*batches[0])))
        first.start()
        time.sleep(0.1)  # the server is now inside the slow first batch
        rest = [threading.Thread(target=lambda i=i: got.__setitem__(i, clients[i].infer(*batches[i])))
                for i in (1, 2, 3)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(10)
        for i in range(4):
            np.testing.assert_allclose(got[i], want[i], atol=1e-5)
        assert running.server.requests == 4
        assert running.server.batches == 2  # the first alone, the three that waited as one
        assert engine.batch_rows == [2, 6]
    finally:
        running.stop()


class _SlowMarker:
    """Wraps an engine: a batch holding token id 777 takes 0.5 s."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.name, self.dim = engine.name, engine.dim
        self.max_batch_size, self.max_seq_len = engine.max_batch_size, engine.max_seq_len

    def infer(self, ids, mask):
        if (ids == 777).any():
            time.sleep(0.5)
        return self.engine.infer(ids, mask)

    def close(self) -> None:
        self.engine.close()


@needs_model
def test_with_two_engines_a_batch_does_not_wait_for_the_one_still_running(tmp_path):
    running = _Running(tmp_path, _SlowMarker(GpuEngineDouble(ENGINES_DIR)), _SlowMarker(GpuEngineDouble(ENGINES_DIR)))
    try:
        slow, fast = (RemoteEngine(running.path, "torch_cuda", timeout_s=10) for _ in range(2))
        finished: list[str] = []
        t = threading.Thread(target=lambda: (slow.infer(np.array([[0, 777, 2]]), np.array([[1, 1, 1]])),
                                             finished.append("slow")))
        t.start()
        time.sleep(0.1)
        assert fast.infer(np.array([[0, 9, 2]]), np.array([[1, 1, 1]])).shape == (1, 384)
        finished.append("fast")
        t.join(5)
        assert finished == ["fast", "slow"] and running.server.batches == 2
    finally:
        running.stop()


@needs_model
async def test_a_cancelled_remote_batch_never_hands_its_late_reply_to_the_next(tmp_path):
    engine = GpuEngineDouble(ENGINES_DIR)
    running = _Running(tmp_path, _SlowMarker(engine))
    try:
        client = RemoteEngine(running.path, "torch_cuda", timeout_s=10)
        slow = asyncio.ensure_future(client.infer_async(np.array([[0, 777, 2]]), np.array([[1, 1, 1]])))
        await asyncio.sleep(0.1)  # the server is inside the slow batch
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        ids, mask = np.array([[0, 9, 2], [0, 10, 2]]), np.array([[1, 1, 1], [1, 1, 1]])
        got = await client.infer_async(ids, mask)  # on a new connection: its own two rows
        np.testing.assert_allclose(got, engine.infer(ids, mask), atol=1e-5)
        client.close()
    finally:
        running.stop()


class _Launching:
    """Wraps an engine with ``launch`` like torch_cuda's: the launch computes at once, but
    while ``hold`` is set each batch's ``finish`` waits until the test opens its gate; a
    batch holding token id 666 fails in ``finish`` (a GPU fault while it ran)."""

    launch_slots = 2

    def __init__(self, engine) -> None:
        self.engine = engine
        self.name, self.dim = engine.name, engine.dim
        self.max_batch_size, self.max_seq_len = engine.max_batch_size, engine.max_seq_len
        self.launched_rows: list[int] = []
        self.gates: list[threading.Event] = []
        self.unfinished = self.most_unfinished = 0
        self.hold = True
        self._lock = threading.Lock()

    def launch(self, ids, mask):
        out = self.engine.infer(ids, mask)
        gate = threading.Event()
        if not self.hold:
            gate.set()
        with self._lock:
            self.launched_rows.append(ids.shape[0])
            self.gates.append(gate)
            self.unfinished += 1
            self.most_unfinished = max(self.most_unfinished, self.unfinished)

        def finish():
            gate.wait(10)
            with self._lock:
                self.unfinished -= 1
            if (ids == 666).any():
                raise EngineError("device lost")
            return out

        return finish

    def close(self) -> None:
        self.engine.close()


def _wait_for(cond, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@needs_model
def test_the_next_batch_is_launched_behind_the_running_one_and_no_third(tmp_path, tokenizer):
    engine = _Launching(GpuEngineDouble(ENGINES_DIR))
    running = _Running(tmp_path, engine)
    try:
        parts = [QUESTIONS[0:2], QUESTIONS[2:3], QUESTIONS[3:6], QUESTIONS[6:8]]
        batches = [pad_batch([w for ws in tokenizer.encode_batch(p, "query: ") for w in ws], tokenizer.pad_id)
                   for p in parts]
        want = [engine.engine.infer(ids, mask) for ids, mask in batches]
        clients = [RemoteEngine(running.path, "torch_cuda", timeout_s=10) for _ in parts]
        got: dict[int, np.ndarray] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, clients[i].infer(*batches[i])))
                   for i in range(4)]
        threads[0].start()
        _wait_for(lambda: len(engine.launched_rows) == 1)
        threads[1].start()  # launched while the first is unfinished
        _wait_for(lambda: len(engine.launched_rows) == 2)
        threads[2].start()
        threads[3].start()
        time.sleep(0.3)  # two are unfinished: these two wait, together
        assert engine.launched_rows == [2, 1] and not got
        engine.gates[0].set()
        _wait_for(lambda: len(engine.launched_rows) == 3)
        assert engine.launched_rows == [2, 1, 5]  # the two that waited, as one batch
        engine.gates[1].set()
        engine.gates[2].set()
        for t in threads:
            t.join(10)
        for i in range(4):
            np.testing.assert_allclose(got[i], want[i], atol=1e-5)
        assert engine.most_unfinished == 2
        assert (running.server.batches, running.server.requests) == (3, 4)

        # A batch whose GPU work fails after its launch: its caller gets EngineError, the next one runs.
        engine.hold = False
        with pytest.raises(EngineError, match="device lost"):
            clients[0].infer(np.array([[0, 666, 2]]), np.array([[1, 1, 1]]))
        assert clients[0].infer(*batches[1]).shape == (1, 384)
    finally:
        engine.hold = False
        for gate in engine.gates:
            gate.set()
        running.stop()


@needs_model
def test_a_failed_batch_is_an_engine_error_for_its_caller_and_the_connection_stays_usable(tmp_path):
    running = _Running(tmp_path, _SlowFirst(GpuEngineDouble(ENGINES_DIR)))
    try:
        client = RemoteEngine(running.path, "torch_cuda", timeout_s=10)
        ok = (np.array([[0, 9, 2]]), np.array([[1, 1, 1]]))
        assert client.infer(*ok).shape == (1, 384)
        with pytest.raises(EngineError, match="device lost"):
            client.infer(np.array([[0, 666, 2]]), np.array([[1, 1, 1]]))
        assert client.infer(*ok).shape == (1, 384)
        with pytest.raises(EngineError, match=r"outside \[1\.\.256"):
            client.infer(np.zeros((300, 3), dtype=np.int64), np.ones((300, 3), dtype=np.int64))
    finally:
        running.stop()


@needs_model
def test_a_server_with_another_engine_is_refused_and_a_gone_server_is_an_engine_error(tmp_path):
    running = _Running(tmp_path, GpuEngineDouble(ENGINES_DIR))
    with pytest.raises(EngineError, match="runs torch_cuda, not tensorrt"):
        RemoteEngine(running.path, "tensorrt", timeout_s=10)
    client = RemoteEngine(running.path, "torch_cuda", timeout_s=10)
    running.stop()
    with pytest.raises(EngineError, match="engine server at"):
        client.infer(np.array([[0, 9, 2]]), np.array([[1, 1, 1]]))
    with pytest.raises(EngineError, match="unreachable"):
        client.infer(np.array([[0, 9, 2]]), np.array([[1, 1, 1]]))
    with pytest.raises(EngineError, match="unreachable"):
        RemoteEngine(str(tmp_path / "none.sock"), "torch_cuda", timeout_s=1)


# ------------------------------------------------------------------ started by the process pool

@pytest.fixture
def one_fake_gpu(monkeypatch):
    """One 'GPU' for the pool's placement (HEALTHBOT_ASSUME_GPU=1, inherited by the processes),
    tests/worker_doubles.py importable there."""
    monkeypatch.setenv("HEALTHBOT_ASSUME_GPU", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [DOUBLES, os.environ.get("PYTHONPATH")])))


def server_cfg(**kw) -> InferenceConfig:
    return InferenceConfig(device_processes=2, engine_server=True, engine_order=["torch_cuda", "onnxruntime"],
                           onnx_precision="fp32", fallback_engine="onnxruntime", intra_op_threads=1,
                           max_queue_delay_ms=0, circuit_failures=1, circuit_reset_s=0.5, circuit_max_reset_s=1.0,
                           **kw)


#: Deadline of the test of many texts below and of its reference encoder. Its "GPU" is the model on
#: ONE CPU thread (GpuEngineDouble): a round of its texts costs ~1.1 s of CPU there (32 x 16 tokens;
#: 512 + 196 for the long text) and about as much in the workers' CPU fallback or the reference
#: encoder: 1.0-2.0 s of wall time on an idle 2-core machine, up to 3.8 s with both cores busy (the
#: whole suite, CI), past the default 2 s. The longer deadline weakens nothing checked: a request
#: that waited for a dead server instead of failing over at once still misses it (the remote
#: engine's timeout is deadline_ms + 1 s), and none may fail.
CPU_ROUND_DEADLINE_MS = 10_000.0


async def _reference(texts: list[str]) -> np.ndarray:
    enc = await Encoder.create(InferenceConfig(engine_order=["onnxruntime"], onnx_precision="fp32",
                                               fallback_engine="", deadline_ms=CPU_ROUND_DEADLINE_MS), ENGINES_DIR)
    try:
        return await enc.encode(texts)
    finally:
        await enc.close()


@needs_model
async def test_worker_processes_run_their_batches_in_the_engine_server_and_survive_its_death(one_fake_gpu):
    # Enough texts at once that a flush is split over both workers (messages of >= MIN_TEXTS_PER_MESSAGE).
    texts = QUESTIONS * 4 + ["长" * 700]
    ref = await _reference(texts)
    enc = await ProcessPoolEncoder.create(server_cfg(deadline_ms=CPU_ROUND_DEADLINE_MS), ENGINES_DIR,
                                          server_loader="worker_doubles:gpu_engine_double")
    try:
        assert [w.label for w in enc.workers] == ["cuda:0#0", "cuda:0#1"]
        server = enc.servers[0]
        assert server.alive and server.label == "engine-server:cuda:0"
        assert (enc.engine_name, enc.variant) == ("torch_cuda", "torch_cuda/fp32")
        got = np.vstack(await asyncio.gather(*(enc.encode([t]) for t in texts)))
        np.testing.assert_allclose(got, ref, atol=1e-5)
        batches, rows = await enc.server_stats()
        assert rows >= len(texts) + 1 and 1 <= batches <= rows  # the 700-character text is 2 windows

        # The server dies: the workers' batches fail over to their CPU engine, nothing is lost.
        pid = server.info["pid"]
        os.kill(pid, signal.SIGKILL)
        got = np.vstack(await asyncio.gather(*(enc.encode([t]) for t in texts)))
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert {w.engine_name for w in enc.workers} == {"onnxruntime"}
        # It is restarted, and the workers' circuits close again on their next probe.
        for _ in range(200):
            await asyncio.sleep(0.05)
            await asyncio.gather(*(enc.encode([t]) for t in texts))  # traffic for both workers
            if server.alive and server.info["pid"] != pid and {w.engine_name for w in enc.workers} == {"torch_cuda"}:
                break
        assert server.info["pid"] != pid and server.restarts == 1
        assert {w.engine_name for w in enc.workers} == {"torch_cuda"}
        np.testing.assert_allclose(await enc.encode(texts), ref, atol=1e-5)
    finally:
        await enc.close()
    assert enc.servers[0].process.returncode is not None
    assert not Path(enc.servers[0].server_path).parent.exists()


@needs_model
async def test_an_engine_server_stuck_in_a_batch_is_killed_and_restarted(one_fake_gpu, tmp_path, monkeypatch):
    hang = tmp_path / "hang"
    monkeypatch.setenv("GPU_DOUBLE_HANG_FILE", str(hang))
    enc = await ProcessPoolEncoder.create(server_cfg(deadline_ms=1000.0), ENGINES_DIR,
                                          server_loader="worker_doubles:gpu_engine_double")
    try:
        server = enc.servers[0]
        pid = server.info["pid"]
        await enc.encode(QUESTIONS[:2])
        hang.touch()
        with pytest.raises(DeadlineExceeded):  # the stuck batch's callers time out at their deadline
            await enc.encode(QUESTIONS[2:3])
        hang.unlink()
        for _ in range(150):  # killed after deadline + 1 s of running, then restarted
            await asyncio.sleep(0.1)
            if server.restarts == 1 and server.alive:
                break
        assert server.restarts == 1 and server.info["pid"] != pid
        np.testing.assert_allclose(await enc.encode(QUESTIONS[:2]), await _reference(QUESTIONS[:2]), atol=1e-5)
    finally:
        await enc.close()


@needs_model
async def test_an_engine_server_that_cannot_load_leaves_the_workers_on_their_cpu_engine(one_fake_gpu):
    enc = await ProcessPoolEncoder.create(server_cfg(), ENGINES_DIR, server_loader="worker_doubles:no_gpu_engine")
    try:
        assert not enc.servers[0].alive
        assert enc.engine_name == "onnxruntime"
        np.testing.assert_allclose(await enc.encode(QUESTIONS[:2]), await _reference(QUESTIONS[:2]), atol=1e-5)
    finally:
        await enc.close()
