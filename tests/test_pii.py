"""PII masking (safety/pii.py) and its use in logs (bot/logs.py), issue 21: full-width forms,
residential-compound addresses, ID numbers in Chinese numerals; message ids left readable."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from bot.logs import ClientErrorFilter, configure_logging
from safety.pii import fold, mask_pii

try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests.conftest import restored_logging
except ImportError:  # pragma: no cover
    from conftest import restored_logging  # type: ignore[no-redef]


@pytest.mark.parametrize("text,secret,placeholder", [
    ("电话１３６１２３４５６７８", "１３６１２３４５６７８", "[PHONE]"),
    ("电话 １３８－１２３４－５６７８ 找我", "１３８－１２３４－５６７８", "[PHONE]"),
    ("手机一三八一二三四五六七八", "一三八一二三四五六七八", "[PHONE]"),
    ("邮箱 ａｂｃ＠ｅｘａｍｐｌｅ．ｃｏｍ", "ａｂｃ＠ｅｘａｍｐｌｅ．ｃｏｍ", "[EMAIL]"),
    ("邮箱 abc＠example.com 谢谢", "abc＠example.com", "[EMAIL]"),
    ("身份证１１０１０５１９４９１２３１００２Ｘ", "１１０１０５１９４９１２３１００２Ｘ", "[ID]"),
    ("身份证一一零一零五一九四九一二三一零零二X", "一一零一零五一九四九一二三一零零二X", "[ID]"),
    ("身份证号壹壹〇壹〇伍壹玖肆玖壹贰叁壹〇〇贰x", "壹壹〇壹〇伍壹玖肆玖壹贰叁壹〇〇贰x", "[ID]"),
    ("我住天河北小区5栋302，最近失眠", "天河北小区5栋302", "[ADDRESS]"),
    ("阳光花园3号楼2单元501室", "阳光花园3号楼2单元501室", "[ADDRESS]"),
    ("家在翠苑五栋三零二", "翠苑五栋三零二", "[ADDRESS]"),
    ("送到5栋302就行", "5栋302", "[ADDRESS]"),
    ("送到3单元502室", "3单元502室", "[ADDRESS]"),
    ("住建国路88号3号楼", "建国路88号", "[ADDRESS]"),
])
def test_personal_data_in_any_form_is_masked(text, secret, placeholder):
    masked = mask_pii(text)
    assert secret not in masked and placeholder in masked, masked


def test_text_around_the_masked_span_keeps_its_own_characters():
    assert mask_pii("头痛３８．５℃，电话１３６１２３４５６７８。") == "头痛３８．５℃，电话[PHONE]。"
    assert fold("１３６＠Ｘ　一〇") == "136@X 10"
    assert len(fold("任意文字ＡＢＣ一二三")) == len("任意文字ＡＢＣ一二三")


@pytest.mark.parametrize("text", [
    "血压140/90，心率78，空腹血糖6.1",
    "一日三次，每次两片，三七粉冲服",
    "头痛３８．５℃，吃了布洛芬",
    "第一天到第七天，每天一到两次",
    "住在五楼，爬楼梯会喘",
    "他今年六十八岁，一年前做过手术",
])
def test_health_text_with_numbers_is_left_alone(text):
    assert mask_pii(text) == text


@pytest.fixture
def json_log():
    buf = io.StringIO()
    with restored_logging():
        configure_logging("INFO", "json", stream=buf)
        yield buf


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_message_ids_are_not_masked_in_logs_but_the_text_is(json_log):
    msgid = "123456789012345678"  # 18 digits: the shape of a resident ID number
    structlog.get_logger("healthbot.test").info(
        "wechat.reply", message_id=msgid, msg_id=msgid, update_id=int(msgid), text=f"号码{msgid}",
        nested={"telegram_message_id": "13812345678:99", "MsgId": msgid, "q": "电话13812345678"},
        user="13812345678")
    (line,) = _lines(json_log)
    assert line["message_id"] == line["msg_id"] == msgid and line["update_id"] == int(msgid)
    assert line["nested"]["telegram_message_id"] == "13812345678:99" and line["nested"]["MsgId"] == msgid
    assert line["text"] == "号码[ID]" and line["nested"]["q"] == "电话[PHONE]" and line["user"] == "[PHONE]"


def test_free_text_under_a_message_id_key_is_still_masked(json_log):
    structlog.get_logger("healthbot.test").info("x", message_id="call me 13812345678")
    (line,) = _lines(json_log)
    assert line["message_id"] == "call me [PHONE]"


def test_aiohttp_bad_request_tracebacks_become_one_warning(json_log):
    from aiohttp.http_exceptions import InvalidURLError

    server = logging.getLogger("aiohttp.server")
    try:
        raise InvalidURLError("Invalid char in url query:\n\n  b'GET /x?\\xff'\n   ^")
    except InvalidURLError:
        server.exception("Error handling request from %s", "127.0.0.1")
    try:
        raise RuntimeError("a real bug")
    except RuntimeError:
        server.exception("Error handling request from %s", "127.0.0.1")
    client_error, bug = _lines(json_log)
    assert client_error["level"] == "warning" and "exception" not in client_error
    assert "400" in client_error["event"] and "Invalid char in url query" in client_error["event"]
    assert bug["level"] == "error" and "RuntimeError: a real bug" in bug["exception"]


def test_the_filter_leaves_other_records_alone():
    record = logging.LogRecord("aiohttp.access", logging.INFO, __file__, 1, "GET / 200", (), None)
    assert ClientErrorFilter().filter(record) and record.getMessage() == "GET / 200"
