"""adapters/text_split.py: the one splitter of the WeChat and Telegram adapters."""

import pytest

from adapters.text_split import split_text, utf16_len, utf8_len


def test_both_channels_keep_a_closing_bracket_with_its_sentence():
    assert split_text("甲乙丙丁。】戊己庚辛。", 18) == ["甲乙丙丁。】", "戊己庚辛。"]
    telegram = split_text("甲乙丙丁。】戊己庚辛。", 6, size=utf16_len, line_breaks_first=True)
    assert telegram == ["甲乙丙丁。】", "戊己庚辛。"]


def test_telegram_ends_a_part_at_a_line_break_wechat_fills_the_page():
    text = "一二三四五六\n七。八"
    assert split_text(text, 9, size=utf16_len, line_breaks_first=True) == ["一二三四五六", "七。八"]
    assert split_text(text, 9, size=utf16_len) == ["一二三四五六\n七。", "八"]
    assert split_text(text, 27) == ["一二三四五六\n七。", "八"]


def test_the_space_after_an_over_long_sentence_is_kept():
    assert split_text("x" * 20 + ". Next one. End.", 16) == ["x" * 16, "xxxx. Next one.", "End."]


@pytest.mark.parametrize("size", [utf8_len, utf16_len])
def test_every_part_fits_and_nothing_is_lost(size):
    text = "第一句话很长很长，还有逗号，" * 30 + "😀" * 40 + " end."
    for limit in (4, 9, 40, 333):
        parts = split_text(text, limit, size=size)
        assert all(size(p) <= limit for p in parts)
        assert "".join(parts).replace(" ", "") == text.replace(" ", "")
