"""Issue 23's cheap wins on the message path: normalization and OpenCC conversions memoized
(safety/normalize.py), and the log processors' per-key regexes remembered and their own fields
(timestamp, level) skipped (bot/logs.py). Behaviour must be exactly as before."""

from __future__ import annotations

import io
import json

import structlog

from bot.logs import configure_logging
from safety import normalize as nz
from tests.conftest import restored_logging


def test_normalize_is_memoized_and_gives_the_same_result():
    text = "晚上總是睡不著，有什麼辦法？？"
    first = nz.normalize(text)
    assert nz.normalize(text) is first  # the second call is a lookup
    assert first.text == "晚上总是睡不著,有什么办法?"  # OpenCC t2s, punctuation folded and collapsed
    assert first.script == "hant" and first.original == text
    assert nz.normalize(None) == nz.normalize("") and nz.normalize("").text == ""


def test_long_texts_are_not_kept_but_normalized_alike():
    long = "手脚冰凉怎么办。" * (nz.MEMO_MAX_CHARS // 8 + 1)
    assert len(long) > nz.MEMO_MAX_CHARS
    a, b = nz.normalize(long), nz.normalize(long)
    assert a == b and a is not b
    assert a.text.startswith("手脚冰凉怎么办。手脚冰凉")


def test_conversions_are_memoized_and_unchanged():
    reply = "手脚冰凉多见于末梢循环差，注意保暖。"
    assert nz.to_user_script(reply, "hant") == nz.to_user_script(reply, "hant") != reply
    assert nz.to_user_script(reply, "hant", "hk") != reply
    assert nz.to_user_script(reply, "hans") == reply
    assert nz.to_simplified("頭髮掉得厲害") == "头发掉得厉害" == nz.to_simplified("頭髮掉得厲害")
    assert nz.to_simplified(None) == ""


def test_log_lines_still_mask_and_scrub_but_leave_their_own_fields():
    stream = io.StringIO()
    with restored_logging():
        configure_logging("INFO", "json", secrets=["s3cret-token-value"], stream=stream)
        log = structlog.get_logger("healthbot.test")
        for _ in range(2):  # the second line uses the remembered key checks
            log.info("reply", message_id="123456789012345678", phone="13812345678", token="abc",
                     note="key s3cret-token-value here", nested={"api_key": "k", "msgid": "987654321098765432"})
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert len(lines) == 2 and lines[0] == {**lines[1], "timestamp": lines[0]["timestamp"]}
    line = lines[0]
    assert line["message_id"] == "123456789012345678" and line["phone"] == "[PHONE]"
    assert line["token"] == "***" and line["note"] == "key *** here"
    assert line["nested"] == {"api_key": "***", "msgid": "987654321098765432"}
    assert line["level"] == "info" and line["timestamp"].endswith("Z") and line["logger"] == "healthbot.test"
