"""Hot reload: a knowledge-base edit takes effect without a restart; a bad edit keeps the old base."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from bot.knowledge import DEFAULT_KB_DIR
from bot.reload import fingerprint, reload_if_changed
from bot.types import Inbound, MessageKind
from tests.conftest import requires_model

pytestmark = [pytest.mark.model, requires_model]


def sleep_topics(tmp_path) -> tuple[Path, Path, dict]:
    """(a copy of the knowledge base's folder, its sleep.yaml, that file's data)."""
    kb_dir = tmp_path / "kb"
    shutil.copytree(DEFAULT_KB_DIR, kb_dir)
    path = kb_dir / "sleep.yaml"
    return kb_dir, path, yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)


async def test_edit_takes_effect_and_bad_edit_keeps_old_base(dispatcher, tmp_path):
    kb_dir, path, data = sleep_topics(tmp_path)
    original = dispatcher.retriever
    try:
        last = fingerprint(kb_dir)
        snoring = next(t for t in data["topics"] if t["id"] == "sleep.snoring")
        snoring["answer"]["zh"] = "（已更新）" + snoring["answer"]["zh"][:200]
        snoring["questions"]["zh"].append("睡觉时喉咙里像拉风箱一样响")
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        last = await reload_if_changed(dispatcher, kb_dir, last)
        assert dispatcher.retriever is not original
        reply = await dispatcher.handle(Inbound("test", "r1", "r1", "reload-1", MessageKind.TEXT, "打鼾怎么办"))
        assert reply.topic == "sleep.snoring" and "（已更新）" in reply.text

        updated = dispatcher.retriever
        path.write_text("category: sleep\ntopics: [ {id: sleep.snoring, ", encoding="utf-8")
        await reload_if_changed(dispatcher, kb_dir, last)
        assert dispatcher.retriever is updated
        reply = await dispatcher.handle(Inbound("test", "r2", "r2", "reload-2", MessageKind.TEXT, "打呼噜很响怎么办"))
        assert reply.topic == "sleep.snoring" and "（已更新）" in reply.text
    finally:
        dispatcher.retriever = original


async def test_a_reload_keeps_the_topic_prior_for_the_same_topics_and_drops_it_for_others(dispatcher, tmp_path):
    kb_dir, path, data = sleep_topics(tmp_path)
    original = dispatcher.retriever
    assert original.prior is not None
    try:
        last = fingerprint(kb_dir)
        data["topics"][0]["answer"]["zh"] += "（已更新）"
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        last = await reload_if_changed(dispatcher, kb_dir, last)
        assert dispatcher.retriever is not original and dispatcher.retriever.prior is original.prior

        data["topics"] = data["topics"][1:]  # a topic removed: the prior's columns no longer match
        path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        await reload_if_changed(dispatcher, kb_dir, last)
        assert len(dispatcher.retriever.topic_ids) == len(original.topic_ids) - 1
        assert dispatcher.retriever.prior is None
    finally:
        dispatcher.retriever = original
