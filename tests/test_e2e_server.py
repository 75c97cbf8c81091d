"""End to end: the real `healthbot serve` process on loopback, driven as WeChat and an HTTP client would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import requires_model
from tests.wechat_client import WechatSigner, parse_reply, text_xml

pytestmark = [pytest.mark.model, requires_model]
TOKEN = "e2e-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, str, float]:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode(), time.perf_counter() - start
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), time.perf_counter() - start


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "HEALTHBOT_WECHAT_TOKEN": TOKEN, "HEALTHBOT_WECHAT_APPID": "wx0123456789abcdef",
           "HEALTHBOT_DATA_DIR": str(tmp_path_factory.mktemp("data"))}
    proc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if _request(base + "/readyz")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("server not ready within 120 s")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def _wechat(server: str, content: str, msg_id: int) -> tuple[int, dict, float]:
    path, body = WechatSigner(TOKEN).plain_post(text_xml(content, msg_id=msg_id))
    status, text, seconds = _request(server + path, body, {"Content-Type": "text/xml"})
    return status, (parse_reply(text) if status == 200 and text.startswith("<xml>") else {"raw": text}), seconds


def test_signed_wechat_question_gets_a_passive_answer_with_disclaimer(server):
    status, reply, seconds = _wechat(server, "手脚冰凉怎么办", 9000000000000001)
    print(f"wechat round trip: {seconds * 1000:.0f} ms")
    assert status == 200
    assert reply["MsgType"] == "text"
    assert reply["ToUserName"] and reply["FromUserName"]
    assert "手脚" in reply["Content"] or "手足" in reply["Content"]
    assert "【来源】" in reply["Content"]
    assert "不能替代医生" in reply["Content"] or "医生" in reply["Content"].splitlines()[-1]


def test_chest_pain_with_cold_sweat_gets_emergency_guidance_naming_120(server):
    status, reply, _ = _wechat(server, "我爸胸口像压了块石头，一直出冷汗", 9000000000000002)
    assert status == 200
    assert "120" in reply["Content"]
    assert "【来源】" not in reply["Content"]


def test_retried_msgid_gets_the_same_reply(server):
    first = _wechat(server, "失眠怎么调理", 9000000000000003)[1]
    again = _wechat(server, "失眠怎么调理", 9000000000000003)[1]
    assert first["Content"] == again["Content"]


def test_bad_signature_is_403_and_malformed_xml_is_400(server):
    path, body = WechatSigner("wrong-token").plain_post(text_xml("你好"))
    assert _request(server + path, body)[0] == 403
    path, _ = WechatSigner(TOKEN).plain_post(text_xml("你好"))
    assert _request(server + path, b"<xml><Content>broken")[0] == 400


def test_http_callers_without_a_user_id_are_not_one_shared_user(server):
    status, body, _ = _request(server + "/api/chat", '{"text": "转人工"}'.encode())
    first = json.loads(body)
    # This server has no agent console: nobody could answer, so no handoff starts and the user is told so.
    assert status == 200 and first["intent"] == "handoff" and first["user_id"].startswith("anon-")
    assert "没有人工客服" in first["reply"] and "120" in first["reply"]
    # Another caller without a user id gets its own id and the bot's answer.
    other = json.loads(_request(server + "/api/chat", b'{"text": "how much water should I drink a day"}')[1])
    assert other["intent"] == "answer" and other["topic"] == "nutri.water" and other["user_id"] != first["user_id"]
    # The first caller continues with the id it was given, and is answered by the bot, not left waiting.
    again = json.loads(_request(server + "/api/chat", json.dumps(
        {"text": "how much water should I drink a day", "user_id": first["user_id"]}).encode())[1])
    assert again["intent"] == "answer" and again["user_id"] == first["user_id"]


def test_lone_surrogates_in_the_json_are_answered_not_a_500(server):
    # '\ud800' is valid JSON but no UTF-8: it reached SQLite and the logs and gave a 500,
    # an emergency in the same text included.
    status, body, _ = _request(server + "/api/chat", b'{"text": "\\u6211\\u7238\\u80f8\\u53e3\\u75bc\\u5f97\\u5389\\u5bb3'
                               b' \\u51fa\\u51b7\\u6c57\\ud800", "user_id": "surrogate-\\udfff"}',
                               {"Content-Type": "application/json"})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["intent"] == "emergency" and "120" in reply["reply"]
    assert reply["user_id"] == "surrogate-\ufffd"


def test_http_api_and_health_endpoints(server):
    status, body, _ = _request(server + "/api/chat", b'{"text": "how much water should I drink a day"}',
                               {"Content-Type": "application/json"})
    assert status == 200
    assert '"intent": "answer"' in body and '"topic": "nutri.water"' in body
    for bad, error in ((b"not json", "body is not valid JSON: Expecting value (character 0)"),
                       (b'{"text": "\xff"}', "body is not valid UTF-8"), (b"", "body is not valid JSON"),
                       (b"[1, 2]", "body must be a JSON object"),
                       (b'{"text": 5}', "field 'text' (string) is required")):
        status, body, _ = _request(server + "/api/chat", bad)
        assert status == 400 and error in body
    assert _request(server + "/healthz")[0] == 200
    status, body, _ = _request(server + "/readyz")
    assert status == 200 and "onnxruntime" in body


def test_two_users_with_one_message_id_each_get_their_own_reply(server):
    # /api/chat once deduplicated on the message id alone: the second user received the first's (crisis) reply.
    def ask(user: str, text: str) -> dict:
        status, body, _ = _request(server + "/api/chat", json.dumps(
            {"text": text, "user_id": user, "message_id": "shared-id-1"}).encode())
        assert status == 200, body
        return json.loads(body)

    first = ask("leak-a", "我爸胸口疼得厉害，一直出冷汗")
    second = ask("leak-b", "how much water should I drink a day")
    assert first["intent"] == "emergency"
    assert second["intent"] == "answer" and second["topic"] == "nutri.water" and "120" not in second["reply"]
    assert ask("leak-a", "something else entirely")["reply"] == first["reply"]  # a retry still gets its own reply


@pytest.mark.parametrize("body, headers", [
    (b'{"text": "hi", "n": ' + b"9" * 5000 + b"}", {}),
    (b"[" * 30_000 + b"]" * 30_000, {}),  # under the 64 KiB body limit, past the parser's recursion limit
    (b'{"text": "hi", "user_id": {"a": 1}}', {}),
    (b'{"text": "hi", "message_id": "' + b"x" * 500 + b'"}', {}),
])
def test_http_api_refuses_hostile_bodies_with_a_json_400(server, body, headers):
    status, text, _ = _request(server + "/api/chat", body, headers)
    assert status == 400, text
    assert json.loads(text)["error"]


def test_http_api_reads_json_as_utf8_whatever_charset_is_declared(server):
    status, text, _ = _request(server + "/api/chat", '{"text": "你好"}'.encode(),
                               {"Content-Type": "application/json; charset=foo"})
    assert status == 200, text
    assert json.loads(text)["intent"] == "greeting"
