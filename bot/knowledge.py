"""The curated knowledge base: loading, schema validation, rendering of answers.

File format: docs/kb_schema.md (one YAML file per category under ``bot/kb/``).
The topic catalogue (``bot/catalogue.yaml``, a copy of ../shared/topics.yaml) is
the contract with the evaluation files: every catalogue id must be covered.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bot.reply_limits import PASSIVE_TEXT_MAX_BYTES
from safety.disclaimer import with_disclaimer
from safety.review import review

LANGS = ("zh", "en")

#: Character limits per field (docs/kb_schema.md). They keep a rendered answer,
#: with source line and disclaimer, inside one WeChat passive reply
#: (PASSIVE_TEXT_MAX_BYTES = 2048 bytes; a CJK character is 3 bytes in UTF-8).
FIELD_LIMITS: dict[str, dict[str, int]] = {
    "answer": {"zh": 260, "en": 700},
    "see_doctor": {"zh": 100, "en": 280},
    "facet": {"zh": 220, "en": 600},
}

#: The heading every topic's ``see_doctor`` is shown under (in an answer, a facet reply, an offer).
SEE_DOCTOR_HEADING: dict[str, str] = {"zh": "何时就医", "en": "When to see a doctor"}
#: The facet name a follow-up asks for that text by ("什么时候要看医生"): every topic has it.
SEE_DOCTOR = "see_doctor"

#: The facets a topic may add beside its main answer, with the heading each is shown
#: under (docs/kb_schema.md). "When to see a doctor" is every topic's ``see_doctor``.
FACETS: dict[str, dict[str, str]] = {
    "causes": {"zh": "原因", "en": "Why it happens"},
    "diet": {"zh": "饮食", "en": "Diet"},
    "activity": {"zh": "运动和生活习惯", "en": "Exercise and daily habits"},
    "elders": {"zh": "老年人", "en": "Older people"},
    "children": {"zh": "儿童", "en": "Children"},
    "pregnancy": {"zh": "孕期和哺乳期", "en": "Pregnancy and breastfeeding"},
}

CATALOGUE_PATH = Path(__file__).parent / "catalogue.yaml"
DEFAULT_KB_DIR = Path(__file__).parent / "kb"


class KnowledgeBaseError(ValueError):
    """The knowledge base is invalid. ``problems`` lists each one as "file: field: what"."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("knowledge base invalid:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Source:
    """A named public authoritative source and the recommendation it backs."""

    name: dict[str, str]
    backs: str
    #: backs only facets (``for: facets``, or ``for: [children, ...]`` naming which): named under
    #: those facets' replies, not under the main answer
    for_facets: bool = False
    facets: tuple[str, ...] = ()  # empty: every facet

    def cited_for(self, facet: str | None) -> bool:
        """Whether the source is named under the main answer (``None``) or under ``facet``."""
        if not self.for_facets:
            return True
        return facet is not None and (not self.facets or facet in self.facets)


@dataclass(frozen=True)
class Topic:
    """One knowledge-base topic, bilingual (``zh`` Simplified Chinese, ``en`` English)."""

    id: str
    category: str
    reviewed: str
    title: dict[str, str]
    questions: dict[str, list[str]]
    answer: dict[str, str]
    see_doctor: dict[str, str]
    sources: tuple[Source, ...]
    file: str
    #: facet name (a key of :data:`FACETS`) -> {"zh": text, "en": text}; may be empty
    facets: dict[str, dict[str, str]] = field(default_factory=dict)
    #: facet name -> the id of another topic whose main answer is that facet
    #: ("diet" of chronic.hypertension_lifestyle is chronic.hypertension_diet)
    facet_topics: dict[str, str] = field(default_factory=dict)

    def source_names(self, lang: str, facet: str | None = None) -> str:
        """The names in ``lang`` of the sources cited under the main answer (``facet`` None) or
        under ``facet``, joined."""
        names = [s.name[lang] for s in self.sources if s.cited_for(facet)]
        return ("；" if lang == "zh" else "; ").join(names)

    def facet_text(self, facet: str, lang: str) -> str:
        """``facet``'s text in ``lang`` as the reply shows it: without a lead that repeats the
        heading the reply already puts in front ("Pregnancy and breastfeeding: 1. …").

        Raises:
            KeyError: the topic has no such facet.
        """
        text = self.facets[facet][lang]
        lead = f"{FACETS[facet][lang]}{'：' if lang == 'zh' else ':'}"
        return text[len(lead):].lstrip() if text.lower().startswith(lead.lower()) else text

    def render(self, lang: str, facet: str | None = None) -> str:
        """The reply body in ``lang``, no disclaimer: the main answer, or ``facet``'s text under
        its heading, then when to see a doctor and the sources; for ``facet`` :data:`SEE_DOCTOR`,
        when to see a doctor under the topic's title, then the sources.

        Raises:
            KeyError: ``facet`` is given and the topic has no such facet.
        """
        if facet == SEE_DOCTOR:
            return f"{self._headed(SEE_DOCTOR_HEADING[lang], self.see_doctor[lang], lang)}\n{self._sources_line(lang)}"
        body = self.answer[lang] if facet is None else self._headed(FACETS[facet][lang], self.facet_text(facet, lang), lang)
        return f"{body}\n{self.see_doctor_line(lang)}\n{self._sources_line(lang, facet)}"

    def _headed(self, heading: str, text: str, lang: str) -> str:
        """``text`` under the topic's title and ``heading``: "【失眠·饮食】…", "Insomnia, diet: …"."""
        return f"【{self.title['zh']}·{heading}】{text}" if lang == "zh" else f"{self.title['en']}, {heading.lower()}: {text}"

    def _sources_line(self, lang: str, facet: str | None = None) -> str:
        names = self.source_names(lang, facet)
        return f"【来源】{names}" if lang == "zh" else f"Source: {names}"

    def see_doctor_line(self, lang: str) -> str:
        """When to see a doctor, under its heading (:data:`SEE_DOCTOR_HEADING`), in ``lang``."""
        heading = SEE_DOCTOR_HEADING[lang]
        return f"【{heading}】{self.see_doctor['zh']}" if lang == "zh" else f"{heading}: {self.see_doctor['en']}"


@dataclass(frozen=True)
class KnowledgeBase:
    """All topics, by id, plus two content hashes.

    Attributes:
        digest: sha256 of the files: any edit changes it (a hot reload compares it, bot/reload.py).
        index_digest: sha256 of what retrieval and the learned models read, in order: each topic's id,
            title, example questions and main answer. The caches in engines/cache are keyed by it, so an
            edit of facets, "when to see a doctor" or sources retrains nothing at the next start.
    """

    topics: dict[str, Topic]
    digest: str
    index_digest: str

    def __len__(self) -> int:
        return len(self.topics)


def _bilingual(where: str, value: Any, field: str, problems: list[str], limit: dict[str, int] | None = None,
               kind: type = str) -> dict:
    if not isinstance(value, dict):
        problems.append(f"{where}: {field}: missing or not a mapping with zh/en")
        return {}
    out = {}
    for lang in LANGS:
        v = value.get(lang)
        if kind is str:
            if not isinstance(v, str) or not v.strip():
                problems.append(f"{where}: {field}.{lang}: missing or empty")
                continue
            v = v.strip()
            if limit and len(v) > limit[lang]:
                problems.append(f"{where}: {field}.{lang}: {len(v)} characters, limit {limit[lang]}")
        else:
            if not isinstance(v, list) or not v or not all(isinstance(q, str) and q.strip() for q in v):
                problems.append(f"{where}: {field}.{lang}: needs a non-empty list of strings")
                continue
            v = [q.strip() for q in v]
        out[lang] = v
    return out


def _parse_topic(file: str, index: int, raw: Any, category: str, problems: list[str]) -> Topic | None:
    where = f"{file}: topics[{index}]"
    if not isinstance(raw, dict):
        problems.append(f"{where}: not a mapping")
        return None
    tid = raw.get("id")
    if not isinstance(tid, str) or not tid:
        problems.append(f"{where}: id: missing")
        return None
    where = f"{file}: {tid}"
    if not tid.startswith(category + "."):
        problems.append(f"{where}: id: does not start with the file's category {category!r}")
    n_before = len(problems)
    reviewed = raw.get("reviewed")
    if isinstance(reviewed, _dt.date):
        reviewed = reviewed.isoformat()
    try:
        _dt.date.fromisoformat(str(reviewed))
    except ValueError:
        problems.append(f"{where}: reviewed: missing or not an ISO date")
    title = _bilingual(where, raw.get("title"), "title", problems)
    questions = _bilingual(where, raw.get("questions"), "questions", problems, kind=list)
    answer = _bilingual(where, raw.get("answer"), "answer", problems, FIELD_LIMITS["answer"])
    see_doctor = _bilingual(where, raw.get("see_doctor"), "see_doctor", problems, FIELD_LIMITS["see_doctor"])
    sources = []
    raw_sources = raw.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        problems.append(f"{where}: sources: at least one named source is required")
    else:
        for j, s in enumerate(raw_sources):
            if not isinstance(s, dict):
                problems.append(f"{where}: sources[{j}]: not a mapping")
                continue
            name = _bilingual(where, s.get("name"), f"sources[{j}].name", problems)
            backs = s.get("backs")
            if not isinstance(backs, str) or not backs.strip():
                problems.append(f"{where}: sources[{j}].backs: say which recommendation the source backs")
            scope = s.get("for")
            named = tuple(scope) if isinstance(scope, list) else ()
            if not (scope in (None, "facets") or named and all(f in FACETS for f in named)):
                problems.append(f"{where}: sources[{j}].for: 'facets' or a list of facet names "
                                f"({', '.join(FACETS)})")
            sources.append(Source(name=name, backs=str(backs or "").strip(), for_facets=scope is not None,
                                  facets=named))
    facets, facet_topics = _parse_facets(where, raw.get("facets"), problems)
    if len(problems) > n_before:
        return None
    topic = Topic(id=tid, category=category, reviewed=str(reviewed), title=title, questions=questions,
                  answer=answer, see_doctor=see_doctor, sources=tuple(sources), file=file, facets=facets,
                  facet_topics=facet_topics)
    for facet in (None, *facets):
        for lang in LANGS:
            text, which = topic.render(lang, facet), f"rendered {lang} reply{f' (facet {facet})' if facet else ''}"
            size = len(with_disclaimer(text, lang).encode("utf-8"))
            if size > PASSIVE_TEXT_MAX_BYTES:
                problems.append(f"{where}: {which} is {size} bytes, WeChat's passive reply limit is {PASSIVE_TEXT_MAX_BYTES}")
            blocked = review(text, lang).reasons  # the outgoing check would send its fallback instead
            if blocked:
                problems.append(f"{where}: {which} is blocked by safety/review.py ({', '.join(blocked)}): reword it")
    return topic


def _parse_facets(where: str, raw: Any, problems: list[str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The optional ``facets`` mapping: known names only, each bilingual within the facet limits
    or ``{see: <topic id>}`` (another topic answers it). Returns (texts, topic references)."""
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: facets: not a mapping of facet name to zh/en texts")
        return {}, {}
    texts, refs = {}, {}
    for name, value in raw.items():
        if name not in FACETS:
            problems.append(f"{where}: facets.{name}: unknown facet (known: {', '.join(FACETS)})")
        elif isinstance(value, dict) and set(value) == {"see"} and isinstance(value["see"], str):
            refs[name] = value["see"]
        else:
            text = _bilingual(where, value, f"facets.{name}", problems, FIELD_LIMITS["facet"])
            if len(text) == len(LANGS):
                texts[name] = text
    return texts, refs


def load_knowledge_base(kb_dir: Path = DEFAULT_KB_DIR) -> KnowledgeBase:
    """Load and validate every ``*.yaml`` file in ``kb_dir``.

    Raises:
        KnowledgeBaseError: listing every problem found (file, field, what is wrong):
            YAML syntax, schema, duplicate ids, length limits.
    """
    problems: list[str] = []
    topics: dict[str, Topic] = {}
    h = hashlib.sha256()
    files = sorted(Path(kb_dir).glob("*.yaml"))
    if not files:
        raise KnowledgeBaseError([f"{kb_dir}: no *.yaml knowledge-base files"])
    for path in files:
        data_bytes = path.read_bytes()
        h.update(path.name.encode() + b"\0" + data_bytes)
        try:
            data = yaml.load(data_bytes, Loader=yaml.CSafeLoader)
        except yaml.YAMLError as exc:
            problems.append(f"{path.name}: YAML syntax: {exc}".replace("\n", " "))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("topics"), list):
            problems.append(f"{path.name}: top level needs 'category' and a 'topics' list")
            continue
        category = data.get("category") or path.stem
        for i, raw in enumerate(data["topics"]):
            topic = _parse_topic(path.name, i, raw, str(category), problems)
            if topic is None:
                continue
            if topic.id in topics:
                problems.append(f"{path.name}: {topic.id}: duplicate id (also in {topics[topic.id].file})")
                continue
            topics[topic.id] = topic
    problems += [f"{t.file}: {t.id}: facets.{name}: see: no topic {ref!r}" for t in topics.values()
                 for name, ref in t.facet_topics.items() if ref not in topics or ref == t.id]
    if problems:
        raise KnowledgeBaseError(problems)
    read = [[t.id, t.title, t.questions, t.answer] for t in topics.values()]
    return KnowledgeBase(topics=topics, digest=h.hexdigest(), index_digest=hashlib.sha256(
        json.dumps(read, ensure_ascii=False, sort_keys=True).encode()).hexdigest())


def load_catalogue(path: Path = CATALOGUE_PATH) -> list[str]:
    """Topic ids of the catalogue (../shared/topics.yaml format), in catalogue order."""
    data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    return [t["id"] for t in data["topics"]]


def check_knowledge_base(kb_dir: Path = DEFAULT_KB_DIR, catalogue: Path = CATALOGUE_PATH) -> list[str]:
    """Every problem of the base: schema, sources, ids, lengths, and catalogue coverage.

    Returns:
        A list of problems, empty when the base is valid and covers the catalogue.
    """
    try:
        kb = load_knowledge_base(kb_dir)
    except KnowledgeBaseError as exc:
        return exc.problems
    wanted = load_catalogue(catalogue)
    problems = [f"catalogue: {tid}: not covered by the knowledge base" for tid in wanted if tid not in kb.topics]
    problems += [f"{kb.topics[t].file}: {t}: id is not in the catalogue" for t in kb.topics if t not in set(wanted)]
    return problems
