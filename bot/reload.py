"""Hot reload of the knowledge base: edits to ``bot/kb/*.yaml`` take effect without a restart.

The folder is polled (every ``interval_s`` seconds) for a change of its files'
names, sizes and modification times. A changed base is loaded and validated; if
it is valid, a new retriever is built (only new or changed questions are
embedded) and swapped in with one assignment, so requests in flight finish on the
old one. If it is invalid, the old base keeps serving and the problems are logged.

The new retriever keeps the old topic prior (bot/topic_prior.py) when the topics are the
same (an edit of answers or examples); when topics were added or removed it ranks by the
hybrid score alone until the next start or model reload trains a prior for them (training
takes seconds of CPU in every serving process).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import structlog

from bot.knowledge import KnowledgeBaseError, load_knowledge_base
from bot.retrieval import Retriever

log = structlog.get_logger("healthbot.reload")


def fingerprint(kb_dir: Path) -> tuple:
    """(name, size, mtime_ns) of every ``*.yaml`` file in ``kb_dir``, sorted."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(kb_dir).glob("*.yaml")))


async def reload_if_changed(dispatcher, kb_dir: Path, last: tuple, lock: asyncio.Lock | None = None) -> tuple:
    """Reload once if the folder changed since ``last``; returns the new fingerprint.

    A bad edit is logged (``kb.reload_rejected`` with every problem) and the old base stays.
    The new retriever is built and swapped in holding ``lock`` when given (the model reload's,
    bot/model_reload.py: it must not be built with an encoder a model swap is replacing).
    """
    now = fingerprint(kb_dir)
    if now == last:
        return now
    try:
        kb = load_knowledge_base(kb_dir)
    except KnowledgeBaseError as exc:
        log.error("kb.reload_rejected", problems=exc.problems, kept_topics=len(dispatcher.kb))
        return now
    async with lock or contextlib.nullcontext():
        old = dispatcher.retriever
        if kb.digest == old.kb.digest:
            return now
        new = await Retriever.build(kb, old.encoder, known=old.known_vectors())
        new.mode = old.mode
        if new.topic_ids == old.topic_ids:
            new.prior = old.prior
        elif old.prior is not None:
            log.warning("kb.topic_prior_off", why="topics added or removed", until="the next start or model reload")
        dispatcher.retriever = new
    log.info("kb.reloaded", topics=len(kb), digest=kb.digest[:12])
    return now


async def watch_knowledge_base(dispatcher, kb_dir: Path, interval_s: float = 2.0,
                               lock: asyncio.Lock | None = None) -> None:
    """Poll ``kb_dir`` forever (cancel the task to stop); each reload holds ``lock`` when given."""
    last = fingerprint(kb_dir)
    while True:
        await asyncio.sleep(interval_s)
        try:
            last = await reload_if_changed(dispatcher, kb_dir, last, lock)
        except Exception:  # never let the watcher die: the old base keeps serving
            log.exception("kb.reload_failed")
