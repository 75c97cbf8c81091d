"""Blood-pressure readings told in a message (safety/readings.py, safety/readings.yaml)."""

from __future__ import annotations

import pytest
import yaml

from safety.normalize import normalize
from safety.readings import TABLE, Reading, chinese_number, moderate_bp, readings

EXAMPLES = yaml.safe_load(TABLE.read_text(encoding="utf-8"))["examples"]


@pytest.mark.parametrize("q", EXAMPLES["moderate"])
def test_the_tables_moderate_examples_are_moderate(q):
    assert moderate_bp(normalize(q).text)


@pytest.mark.parametrize("q", EXAMPLES["not_moderate"])
def test_the_tables_other_examples_are_not(q):
    assert moderate_bp(normalize(q).text) == ""


@pytest.mark.parametrize("words, value", [("一百五", 150), ("一百五十五", 155), ("一百零五", 105), ("九十五", 95),
                                          ("两百", 200), ("一百", 100), ("140", 140)])
def test_chinese_numerals_of_readings(words, value):
    assert chinese_number(words) == value


@pytest.mark.parametrize("q, found", [
    ("血壓１４５／９５ 要緊嗎", (Reading(145, 95),)),
    ("my blood pressure was 155 over 98", (Reading(155, 98),)),
    ("高压一百五低压九十五", (Reading(150, None), Reading(None, 95))),
    ("sat 10 min and retested 122/78. ok right", (Reading(122, 78),)),
    ("血压高了20年了", ()),             # years, not a reading
    ("11/30体检 一切正常", ()),          # a date
    ("疼痛评分5/10", ()),
])
def test_readings_in_digits_words_and_both_scripts(q, found):
    assert readings(normalize(q).text) == found


@pytest.mark.parametrize("q", ["孕36周 血压150/95 头很痛", "产后两周 血压150/100 头疼", "血压80/50 头晕出冷汗",
                               "血压185/100 没什么感觉", "低压125 要紧吗"])
def test_pregnancy_birth_low_and_severe_readings_are_left_to_the_head_and_rules(q):
    """Pre-eclampsia (NHS): 140/90 with a headache in pregnancy or after a birth is an emergency; below 90
    may be shock; 180/120 and over is urgent (NHS "High blood pressure")."""
    assert moderate_bp(normalize(q).text) == ""
