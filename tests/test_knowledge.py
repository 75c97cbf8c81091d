"""The knowledge base: schema validation, catalogue coverage, reply size."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bot.knowledge import (DEFAULT_KB_DIR, KnowledgeBaseError, check_knowledge_base, load_catalogue,
                           load_knowledge_base)
from safety.disclaimer import with_disclaimer


def test_packaged_base_is_valid_and_covers_the_catalogue():
    assert check_knowledge_base() == []
    kb = load_knowledge_base()
    assert set(load_catalogue()) <= set(kb.topics)


def test_every_topic_names_a_source_and_when_to_see_a_doctor():
    kb = load_knowledge_base()
    for topic in kb.topics.values():
        for lang in ("zh", "en"):
            text = topic.render(lang)
            own = [s for s in topic.sources if not s.for_facets]
            assert own and all(s.name[lang] in text for s in own)
            assert ("何时就医" if lang == "zh" else "When to see a doctor") in text
            for facet in topic.facets:  # a facet's reply names the topic's sources and those for the facet
                text = topic.render(lang, facet)
                assert all(s.name[lang] in text for s in topic.sources if s.cited_for(facet))


def test_every_rendered_reply_fits_one_wechat_passive_reply():
    kb = load_knowledge_base()
    sizes = [len(with_disclaimer(t.render(lang), lang).encode()) for t in kb.topics.values() for lang in ("zh", "en")]
    print(f"largest rendered reply: {max(sizes)} bytes")
    assert max(sizes) <= 2048


def _copy_base(tmp_path: Path) -> Path:
    kb_dir = tmp_path / "kb"
    shutil.copytree(DEFAULT_KB_DIR, kb_dir)
    return kb_dir


def test_a_bad_file_is_reported_with_file_and_field(tmp_path):
    kb_dir = _copy_base(tmp_path)
    first = sorted(kb_dir.glob("*.yaml"))[0]
    data = yaml.load(first.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    broken = data["topics"][0]
    del broken["sources"]
    broken["answer"]["zh"] = "很长" * 200
    first.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    with pytest.raises(KnowledgeBaseError) as err:
        load_knowledge_base(kb_dir)
    text = "\n".join(err.value.problems)
    assert f"{first.name}: {broken['id']}: sources" in text
    assert f"{first.name}: {broken['id']}: answer.zh: 400 characters, limit 260" in text


def test_a_text_the_outgoing_review_would_block_is_a_problem(tmp_path):
    """safety/review.py replaces a whole reply that reads as a diagnosis or a medicine change with
    its fallback: such a sentence in the base (e.g. "换药" for changing a dressing) would silently
    stop the topic from ever being answered, so kb check names it."""
    kb_dir = _copy_base(tmp_path)
    first = sorted(kb_dir.glob("*.yaml"))[0]
    data = yaml.load(first.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    topic = data["topics"][0]
    topic["answer"]["en"] = topic["answer"]["en"][:200] + " You have gastritis."
    first.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    with pytest.raises(KnowledgeBaseError) as err:
        load_knowledge_base(kb_dir)
    assert any(topic["id"] in p and "blocked by safety/review.py (diagnosis:" in p for p in err.value.problems)


def test_duplicate_ids_and_missing_catalogue_topics_are_problems(tmp_path):
    kb_dir = _copy_base(tmp_path)
    files = sorted(kb_dir.glob("*.yaml"))
    data = yaml.load(files[0].read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    removed = data["topics"].pop(0)
    files[0].write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    problems = check_knowledge_base(kb_dir)
    assert f"catalogue: {removed['id']}: not covered by the knowledge base" in problems
    data["topics"].append(data["topics"][0])
    files[0].write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    assert any("duplicate id" in p for p in check_knowledge_base(kb_dir))


def test_kb_check_command_exits_nonzero_with_the_problems(tmp_path):
    kb_dir = _copy_base(tmp_path)
    (kb_dir / "broken.yaml").write_text("category: broken\ntopics: [ {id: broken.x, ", encoding="utf-8")
    env = {"HEALTHBOT_KNOWLEDGE_KB_DIR": str(kb_dir), "PATH": "/usr/bin:/bin"}
    bad = subprocess.run([sys.executable, "-m", "bot.cli", "kb", "check"], capture_output=True, text=True, env=env)
    assert bad.returncode == 1
    assert "broken.yaml: YAML syntax" in bad.stdout
    good = subprocess.run([sys.executable, "-m", "bot.cli", "kb", "check"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert good.returncode == 0, good.stdout + good.stderr
    assert "every catalogue topic covered" in good.stdout


def test_the_models_cache_key_changes_with_what_they_read_not_with_facets_or_sources(tmp_path):
    """engines/cache is keyed by ``index_digest`` (ids, titles, questions, answers): a clinician's edit
    of a facet or a source retrains nothing at the next start; a new example question does."""
    base = load_knowledge_base(_copy_base(tmp_path / "a"))
    kb_dir = _copy_base(tmp_path / "b")
    path = kb_dir / "sleep.yaml"
    text = path.read_text(encoding="utf-8")
    facet = base.topics["sleep.insomnia"].facets["diet"]["zh"]
    assert facet[:20] in text
    path.write_text(text.replace(facet[:20], facet[:20] + "。", 1), encoding="utf-8")
    edited = load_knowledge_base(kb_dir)
    assert edited.topics["sleep.insomnia"].facets["diet"]["zh"] != facet
    assert edited.digest != base.digest and edited.index_digest == base.index_digest
    question = base.topics["sleep.insomnia"].questions["zh"][0]
    path.write_text(path.read_text(encoding="utf-8").replace(question, question + "呢", 1), encoding="utf-8")
    assert load_knowledge_base(kb_dir).index_digest != base.index_digest
