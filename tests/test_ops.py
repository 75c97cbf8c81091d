"""Operations: health checks, structured logs with personal data masked, config errors at start,
and graceful shutdown of a real ``healthbot serve`` process (loopback only, bounded in time)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog

from bot.app import STORE_PING_TIMEOUT_S, ServerState, readiness
from bot.config import REPO_ROOT
from bot.logs import SecretScrubber, configure_logging, request_id_from_header
from bot.types import Inbound, MessageKind
from tests.conftest import requires_model, restored_logging

PHONE, PHONE_SPACED, ID_NUMBER = "13812345678", "139 8765 4321", "110101199003074518"
PII_TEXT = f"我电话{PHONE}，也可以打{PHONE_SPACED}，身份证{ID_NUMBER}，失眠怎么调理"

#: Graceful-shutdown bound given to the server under test, seconds (server.shutdown_timeout_s).
SHUTDOWN_TIMEOUT_S = 6.0
#: The batcher holds a batch open this long for more requests (inference.max_queue_delay_ms), so
#: requests are certainly in flight, waiting in the batcher, when SIGTERM arrives.
HOLD_MS = 2000
IN_FLIGHT = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, headers: dict | None = None,
             timeout: float = 30) -> tuple[int, str, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def _serve_cmd(port: int) -> list[str]:
    """``healthbot serve`` (the console script's module, run by this interpreter)."""
    return [sys.executable, "-m", "bot.cli", "serve", "--port", str(port)]


# ------------------------------------------------------------------ logs (in process)


@pytest.fixture
def captured_logs():
    """The production logging set-up (bot.logs, JSON) writing into a buffer; restored afterwards."""
    buf = io.StringIO()
    with restored_logging():
        configure_logging("INFO", "json", secrets=["tg-secret-0123456789"], stream=buf)
        yield buf


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


@requires_model
async def test_reply_log_line_masks_phone_and_id_numbers_and_has_every_field(dispatcher, captured_logs):
    inbound = Inbound(channel="http", user_id=PHONE, chat_id=PHONE, message_id=f"ops-{time.time_ns()}",
                      kind=MessageKind.TEXT, text=PII_TEXT)
    with structlog.contextvars.bound_contextvars(request_id="req-pii-1"):
        reply = await dispatcher.handle(inbound)
        structlog.get_logger("healthbot.test").warning("user_text", text=PII_TEXT, nested={"raw": [PII_TEXT]})
    out = captured_logs.getvalue()
    for secret in (PHONE, PHONE_SPACED, ID_NUMBER, "8765 4321"):
        assert secret not in out
    (line,) = [ln for ln in _lines(captured_logs) if ln["event"] == "reply"]
    assert line["request_id"] == "req-pii-1"
    assert line["user"].startswith("u_") and len(line["user"]) == 14  # pseudonym, never the id itself
    # Contact details beside a question lower the decision head's p(answer) (answer or an honest no_answer).
    assert line["channel"] == "http" and line["intent"] == reply.intent.value in ("answer", "no_answer")
    assert line["topic"] == reply.topic and line["engine"] == "onnxruntime"
    assert 0 <= line["confidence"] <= 1 and line["latency_ms"] > 0
    assert line["input_chars"] == len(PII_TEXT) and line["outcome"] == reply.intent.value
    assert line["level"] == "info" and line["timestamp"].endswith("Z")
    (text_line,) = [ln for ln in _lines(captured_logs) if ln["event"] == "user_text"]
    assert "[PHONE]" in text_line["text"] and "[ID]" in text_line["text"]
    assert "[ID]" in text_line["nested"]["raw"][0]


def test_exceptions_and_standard_library_lines_are_masked_and_secrets_scrubbed(captured_logs):
    log = structlog.get_logger("healthbot.test")
    try:
        raise ValueError(f"lookup failed for {ID_NUMBER}")
    except ValueError:
        log.exception("failed", url="https://api.telegram.org/bottg-secret-0123456789/sendMessage",
                      token="abc", email="someone@example.com")
    logging.getLogger("aiohttp.server").warning("client %s sent %s", PHONE, "上海市南京东路100号")
    out = captured_logs.getvalue()
    assert ID_NUMBER not in out and PHONE not in out and "tg-secret-0123456789" not in out
    assert "someone@example.com" not in out and "南京东路100号" not in out
    failed, stdlib = _lines(captured_logs)
    assert failed["token"] == "***" and failed["url"] == "https://api.telegram.org/bot***/sendMessage"
    assert "ValueError: lookup failed for [ID]" in failed["exception"]
    assert stdlib["logger"] == "aiohttp.server" and stdlib["event"] == "client [PHONE] sent [ADDRESS]"


_LOG_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[1])
import structlog
from bot.logs import configure_logging
configure_logging("INFO", "json", [])
for i in range(1500):
    structlog.get_logger("t").info("line", n=i, pid=os.getpid(), pad="x" * 200)
"""


def test_processes_sharing_one_stderr_never_put_two_lines_on_one(tmp_path: Path):
    """serve --processes N: the front ends share one stderr. With PYTHONUNBUFFERED, print() wrote a
    line and its newline apart, and 1,742 of 12,000 lines from four processes came out broken."""
    shared = tmp_path / "shared.log"
    with shared.open("ab") as err:
        procs = [subprocess.Popen([sys.executable, "-c", _LOG_WRITER, str(REPO_ROOT)], stderr=err,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}) for _ in range(4)]
        assert [p.wait(timeout=60) for p in procs] == [0] * 4
    lines = shared.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 6000
    assert all(json.loads(line)["event"] == "line" for line in lines)


def test_console_format_is_human_readable():
    buf = io.StringIO()
    with restored_logging():
        configure_logging("INFO", "console", stream=buf)
        structlog.get_logger("healthbot.test").info("reply", user=PHONE)
    line = buf.getvalue()
    assert not line.lstrip().startswith("{") and "reply" in line and "user=[PHONE]" in line


def test_request_ids_from_callers_are_kept_only_when_well_formed():
    assert request_id_from_header("lb-7f3a_01.2:x") == "lb-7f3a_01.2:x"
    for bad in (None, "", "a" * 65, "x\ny", 'a"b'):
        generated = request_id_from_header(bad)
        assert len(generated) == 32 and generated != bad and int(generated, 16) >= 0
    # unique within a process and across forked front ends (bot/prefork.py forks them)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, " ".join(request_id_from_header(None) for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 1 << 16).decode().split()
    os.waitpid(pid, 0)
    own = [request_id_from_header(None) for _ in range(100)]
    assert len(child) == 100 and len(set(own + child)) == 200


def test_secret_named_keys_are_redacted_at_any_depth():
    out = SecretScrubber(["0123456789"])(None, "info", {
        "event": "x", "cfg": {"wechat": {"aes_key": "k" * 43, "token": "t"}, "n": "id 0123456789"},
        "max_batch_tokens": 8192, "authorization": "Bearer z"})
    assert out["cfg"]["wechat"] == {"aes_key": "***", "token": "***"} and out["cfg"]["n"] == "id ***"
    assert out["max_batch_tokens"] == 8192 and out["authorization"] == "***"


# ------------------------------------------------------------------ readiness (no model needed)


class _Store:
    def __init__(self, answer):
        self.answer = answer

    async def ping(self) -> bool:
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(10)
        return self.answer


def _loaded(store=None) -> SimpleNamespace:
    """What readiness reads from a dispatcher: the encoder's engine name, the knowledge base, the store."""
    return SimpleNamespace(retriever=SimpleNamespace(encoder=SimpleNamespace(engine_name="onnxruntime")),
                           kb=[object()] * 3, store=store)


async def test_readiness_needs_the_model_and_a_reachable_store_and_ends_at_shutdown():
    state = ServerState()
    assert await readiness(None, state) == (503, {"ready": False, "model_loaded": False, "shutting_down": False})
    status, body = await readiness(_loaded(_Store(True)), state)
    assert status == 200 and body == {"ready": True, "model_loaded": True, "shutting_down": False,
                                      "engine": "onnxruntime", "topics": 3, "store": "ok"}
    assert (await readiness(_loaded(), state))[0] == 200  # no store configured
    assert STORE_PING_TIMEOUT_S < 1.0  # the probe's wait for the store stays inside Kubernetes' 1 s default
    for down in (False, ConnectionError("refused"), "hang"):
        started = time.monotonic()
        status, body = await readiness(_loaded(_Store(down)), state)
        assert status == 503 and body["store"] == "unreachable" and body["engine"] == "onnxruntime"
        # A hung store is given up on after the ping timeout, never waited for (the bound is
        # loose: the whole suite on 2 shared cores once took 1.16 s here for 0.5 s of timeout).
        assert time.monotonic() - started < STORE_PING_TIMEOUT_S + 2.0
    state.shutting_down = True
    status, body = await readiness(_loaded(_Store(True)), state)
    assert status == 503 and body["shutting_down"] is True and body["ready"] is False


# ------------------------------------------------------------------ config errors


@pytest.mark.parametrize("toml, key", [
    ("[server]\nport = 8080\nshutdown_timout_s = 5\n", "shutdown_timout_s"),
    ("[inferense]\nworkers = 2\n", "inferense"),
    ("data_dri = 'x'\n", "data_dri"),
])
def test_a_bad_config_key_fails_at_start_naming_it(tmp_path: Path, toml: str, key: str):
    path = tmp_path / "healthbot.toml"
    path.write_text(toml, encoding="utf-8")
    env = {**os.environ, "HEALTHBOT_CONFIG": str(path)}
    proc = subprocess.run(_serve_cmd(_free_port()), env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert proc.returncode != 0
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_config_value_fails_naming_the_key(tmp_path: Path):
    env = {**os.environ, "HEALTHBOT_SERVER_SHUTDOWN_TIMEOUT_S": "0"}
    proc = subprocess.run([sys.executable, "-m", "bot.cli", "config", "show"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 2 and "server.shutdown_timeout_s" in proc.stderr


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(cfg, dispatcher, tmp_path_factory):
    """``healthbot serve`` on 127.0.0.1 with JSON logs to a file; killed at the end if still running.

    ``dispatcher`` is requested so that the session's retrieval cache exists in the shared data
    directory (start-up then takes seconds).
    """
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "stderr.log"
    env = {**os.environ, "HEALTHBOT_DATA_DIR": cfg.data_dir,
           "HEALTHBOT_WECHAT_TOKEN": "ops-token", "HEALTHBOT_WECHAT_APPID": "wx0123456789abcdef",
           "HEALTHBOT_SERVER_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_TIMEOUT_S),
           "HEALTHBOT_INFERENCE_MAX_QUEUE_DELAY_MS": str(HOLD_MS),
           # an idle engine waits for company too, so the shutdown test's requests are held
           # HOLD_MS in the batcher whatever the machine's speed (with idle dispatch they were
           # answered before the test could see them all in flight on a fast CI host)
           "HEALTHBOT_INFERENCE_IDLE_DISPATCH": "false",
           "HEALTHBOT_INFERENCE_DEADLINE_MS": "20000",
           # no embedding cache: the shutdown test needs its questions held in the batcher, and
           # earlier tests on this server ask the same questions
           "HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "0",
           "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0"}
    env.pop("HEALTHBOT_CONFIG", None)
    with open(log_path, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(_serve_cmd(port), env=env, stdout=subprocess.DEVNULL, stderr=log_file,
                                cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            if _request(base + "/readyz", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("server not ready within 120 s")
    yield proc, base, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@requires_model
def test_healthz_and_readyz_with_the_engine_name(server):
    _, base, _ = server
    status, body, headers = _request(base + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert len(headers["X-Request-Id"]) == 32
    status, body, _ = _request(base + "/readyz")
    ready = json.loads(body)
    assert status == 200 and ready["ready"] is True and ready["model_loaded"] is True
    assert ready["engine"] == "onnxruntime" and ready["topics"] > 0 and ready["shutting_down"] is False
    assert ready["store"] == "ok"  # the default SQLite store under the data directory


@requires_model
def test_the_request_id_of_the_caller_is_echoed_and_logged(server):
    _, base, log_path = server
    status, body, headers = _request(base + "/api/chat", {"text": "hello", "user_id": PHONE},
                                     {"X-Request-Id": "ops-req-42"})
    assert status == 200 and headers["X-Request-Id"] == "ops-req-42"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
        mine = [x for x in lines if x.get("request_id") == "ops-req-42" and x["event"] == "reply"]
        if mine:
            break
        time.sleep(0.05)
    assert mine and mine[0]["user"].startswith("u_") and mine[0]["channel"] == "http"


def _wait_refused(base: str, within_s: float) -> float:
    """When a new TCP connection to ``base`` was first refused (monotonic seconds); fails after ``within_s``."""
    host, port = base.removeprefix("http://").split(":")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except ConnectionRefusedError:
            return time.monotonic()
        time.sleep(0.01)
    pytest.fail(f"new connections still accepted {within_s} s after SIGTERM")


def _in_flight(base: str) -> float:
    _, text, _ = _request(base + "/metrics", timeout=2)
    for line in text.splitlines():
        if line.startswith("healthbot_requests_in_flight "):
            return float(line.split()[1])
    return -1.0


@requires_model
def test_sigterm_answers_every_accepted_request_then_exits_within_the_timeout(server):
    proc, base, log_path = server
    questions = ["失眠怎么调理", "手脚冰凉怎么办", "how much water should I drink a day", PII_TEXT]
    results: list = []
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(lambda n: (_request(base + "/api/chat",
                                                   {"text": questions[n % len(questions)], "user_id": f"u{n}"}),
                                          time.monotonic()), n) for n in range(IN_FLIGHT)]
        deadline = time.monotonic() + HOLD_MS / 1000.0 * 0.8
        while _in_flight(base) < IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _in_flight(base) == IN_FLIGHT, "requests were not all in flight before SIGTERM"
        proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        refused_at = _wait_refused(base, within_s=1.0)  # stopped accepting: the listening socket is closed
        results = [f.result(timeout=SHUTDOWN_TIMEOUT_S + 10) for f in futures]
        rc = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 5)
        exited_at = time.monotonic()
    assert rc == 0
    assert exited_at - sigterm_at < SHUTDOWN_TIMEOUT_S
    for (status, body, _), answered_at in results:
        assert status == 200
        assert json.loads(body)["intent"] in ("answer", "no_answer") and json.loads(body)["reply"]  # a real reply
        assert answered_at > refused_at  # still in flight while new connections were already refused
    events = [json.loads(x)["event"] for x in log_path.read_text().splitlines() if x.startswith("{")]
    assert "shutdown_started" in events and "shutdown_complete" in events and "shutdown_timed_out" not in events
    logs = log_path.read_text()
    assert PHONE not in logs and ID_NUMBER not in logs
