"""Texts tokenized in batches for the dynamic batcher: a tokenizer task drains every
text waiting and tokenizes them with one call of the fast tokenizer's batch API (on a
dedicated thread when more than a few are waiting, inline for a handful)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog

from inference import metrics
from inference.batching.requests import STAGE_INCOMING, STAGE_TOKENIZING, Request

log = structlog.get_logger("healthbot.inference.batcher")

#: Up to this many waiting texts are tokenized on the event loop itself (one
#: short text costs ~20-35 µs there, less than a hop to the tokenizer thread);
#: more go to the tokenizer thread in one batch call.
INLINE_TOKENIZE_MAX = 4

#: Texts tokenized per call of the tokenizer at most.
TOKENIZE_CHUNK = 1024


class TokenizeStage:
    """The tokenizer half of :class:`~inference.batching.batcher.DynamicBatcher`."""

    async def _tokenize_loop(self) -> None:
        loop = self._loop
        incoming = self._incoming
        while True:
            if not incoming:
                if self._closing:
                    return
                self._tok_wakeup.clear()
                await self._tok_wakeup.wait()
                continue
            chunk: list[Request] = []
            while incoming and len(chunk) < TOKENIZE_CHUNK:
                req = incoming.popleft()
                if req.stage == STAGE_INCOMING:
                    req.stage = STAGE_TOKENIZING
                    chunk.append(req)
            if not chunk:
                continue
            self._tokenizing = True
            try:
                if len(chunk) <= self.inline_tokenize_max:
                    windows = self._tokenize_chunk(chunk)
                else:
                    windows = await loop.run_in_executor(self._tokenizer_thread(), self._tokenize_chunk, chunk)
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the chunk
                log.warning("inference_tokenize_failed", texts=len(chunk), error=repr(exc))
                for req in chunk:
                    if req.stage == STAGE_TOKENIZING:
                        fut = req.future
                        self._abandon(req, "failed")
                        if not fut.done():
                            fut.set_exception(exc)
                continue
            finally:
                self._tokenizing = False
            self.stats.tokenize_calls += 1
            self.stats.texts_tokenized += len(chunk)
            added = queued = 0
            largest = self.buckets[-1]
            for req, wins in zip(chunk, windows):
                if req.stage != STAGE_TOKENIZING:  # gone while tokenized; already uncounted
                    continue
                if not wins or (len(wins[0]) > largest if len(wins) == 1 else any(len(w) > largest for w in wins)):
                    fut = req.future
                    self._abandon(req, "failed")
                    fut.set_exception(ValueError(f"tokenizer gave windows of {[len(w) for w in wins]} tokens; "
                                                        f"each must hold 1..{self.buckets[-1]}"))
                    continue
                self._queue_windows(req, wins)
                added += len(wins) - 1
                queued += len(wins)
            self._pending += added
            if queued:
                metrics.INFERENCE_PENDING.inc(queued)
            self._wakeup.set()

    def _tokenizer_thread(self) -> ThreadPoolExecutor:
        if self._tok_executor is None:
            self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference-tokenizer")
        return self._tok_executor

    async def tokenize(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]:
        """Token windows of each text (``tokenize(texts, prefix)``), on the tokenizer thread
        when more than :attr:`inline_tokenize_max` texts (the tokenizer's batch call releases
        the GIL, so this loop keeps batching and delivering meanwhile), else inline.

        Raises:
            RuntimeError: the batcher has no ``tokenize``.
        """
        if self._tokenize is None:
            raise RuntimeError("this DynamicBatcher has no tokenize function")
        if len(texts) <= self.inline_tokenize_max:
            return self._tokenize(texts, prefix)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread(), self._tokenize, texts, prefix)

    def _tokenize_chunk(self, chunk: list[Request]) -> list[list[list[int]]]:
        """Windows of each request's text, in chunk order; one tokenizer call per prefix."""
        prefix = chunk[0].prefix
        if all(r.prefix == prefix for r in chunk):
            return self._tokenize([r.text for r in chunk], prefix)
        out: list = [None] * len(chunk)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(chunk):
            groups.setdefault(r.prefix, []).append(i)
        for p, idx in groups.items():
            for i, wins in zip(idx, self._tokenize([chunk[i].text for i in idx], p)):
                out[i] = wins
        return out
