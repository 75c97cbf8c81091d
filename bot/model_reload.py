"""Model and engine updates without a restart: a new version is loaded beside the serving one,
checked, and swapped in together with everything computed from it; no message fails.

**What starts a reload.** A new ``engines/manifest.json`` (``healthbot prepare-model`` writes it
last, after the model's files): every serving process polls the sha256 of its engines folder's
manifest every ``inference.reload_interval_s`` seconds (0 = off), so each replica picks a new
version up by itself. A new engine version beside an unchanged manifest (``healthbot
build-engine``), or a retry: ``healthbot engine reload`` (:func:`request_reload`), which calls
``POST /api/v1/admin/engine/reload`` of the running server with ``Authorization: Bearer
<server.admin_token>`` (401 without it; 404 while the token is empty: the admin API is off).
A reload asked for while one runs gets that one's outcome.

**A reload, in order** (the old model serves throughout):

1. the manifest and its probe reference are read (inference/probe.py);
2. the engine the configuration chooses (``inference.engine_order``) is loaded into a new
   encoder with its own tokenizer, batcher, pools and (empty) embedding cache;
3. the probe: the parity texts must reproduce the manifest's reference vectors. A version
   that does not load or fails is refused (log ``model.reload_refused``, metric
   ``healthbot_model_reloads_total{outcome="refused"}``), its encoder closed, and the old
   model keeps serving;
4. the knowledge base's vectors, the decision head and the topic-fit verifier are computed
   for the new model (bot/runtime.py ``derive``: cached in engines/cache by model and data
   digest, so seconds when cached, one to three minutes on 2 CPU cores when the model is new);
5. the swap: the dispatcher's retriever (which holds the encoder), head and verifier are
   replaced together, with no await between, so between two messages; the dispatcher reads
   the three once per message, so no message pairs one model's vector with the other's data;
6. the drain: messages begun on the old model finish on it, then its encoder closes (its
   batcher runs what is queued) and its embedding cache is emptied.

Knowledge-base reloads (bot/reload.py) take the same lock, so neither builds on a retriever
the other is replacing. ``/readyz`` (``model``) and ``healthbot_model_info{version,
model_digest,engine}`` name the version serving: ``version`` is the manifest's sha256,
``model_digest`` the ONNX file's (12 hex digits each), ``engine`` ``<engine>/<precision>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from bot import metrics
from bot.config import Config
from bot.http_errors import json_error
from bot.metrics_endpoint import bearer_ok
from bot.runtime import LOG_SETUP, derive, model_digest
from inference.encoder import open_encoder
from inference.model_files import MANIFEST_FILE
from inference.probe import load_reference, run_probe

log = structlog.get_logger("healthbot.model_reload")

__all__ = ["RELOAD_PATH", "ModelReloader", "ModelVersion", "ReloadRefused", "read_manifest", "request_reload",
           "setup_admin"]

RELOAD_PATH = "/api/v1/admin/engine/reload"

#: Longest wait for the messages begun on the old model before its encoder closes, seconds
#: (a message's encoder call has ``inference.deadline_ms``, 2 s by default; the rest is the store).
DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ModelVersion:
    """The model version serving (module doc): ``version`` (manifest sha256, 12 hex digits),
    ``model_digest`` (ONNX sha256, 12 hex digits), ``engine`` (``"onnxruntime/fp32"``)."""

    version: str
    model_digest: str
    engine: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class ReloadRefused(Exception):
    """A new version was not swapped in (the old keeps serving); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_manifest(engines_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """``(sha256 hex of the file, parsed manifest)`` of ``engines_dir/manifest.json``, or None
    while it is missing or not JSON (a preparation is writing the folder)."""
    try:
        raw = (Path(engines_dir) / MANIFEST_FILE).read_bytes()
        manifest = json.loads(raw)
    except (OSError, ValueError):
        return None
    return (hashlib.sha256(raw).hexdigest(), manifest) if isinstance(manifest, dict) else None


def _version(read: tuple[str, dict[str, Any]] | None, engine: str) -> ModelVersion:
    digest, manifest = read or ("", {})
    return ModelVersion(digest[:12], str(manifest.get("onnx_sha256", ""))[:12], engine)


class ModelReloader:
    """Loads, checks and swaps in new model versions for one dispatcher (module doc).

    Create with the config, then :meth:`attach` the dispatcher once it is loaded.

    Attributes:
        lock: held while a retriever is built and swapped in (shared with the KB reload).
        serving: the :class:`ModelVersion` serving (None before :meth:`attach`).
        dispatcher: the dispatcher served (None before :meth:`attach`).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = asyncio.Lock()
        self.serving: ModelVersion | None = None
        self.dispatcher: Any = None
        self._tried = ""  # digest of the manifest last loaded or tried: the watcher's baseline
        self._task: asyncio.Task[ModelVersion] | None = None

    def attach(self, dispatcher: Any, loaded: tuple[str, dict[str, Any]] | None) -> None:
        """Serve ``dispatcher``, whose model was loaded from ``loaded`` (:func:`read_manifest` read
        before the load)."""
        self.dispatcher = dispatcher
        self._tried = loaded[0] if loaded else ""
        self._serve(_version(loaded, dispatcher.retriever.encoder.variant))

    def _serve(self, version: ModelVersion) -> None:
        self.serving = version
        metrics.MODEL_INFO.clear()
        metrics.MODEL_INFO.labels(**version.as_dict()).set(1)

    async def reload(self) -> ModelVersion:
        """Load, check and swap in the engines folder's model now; the running reload's outcome if
        one runs. Returns the version serving after the swap.

        Raises:
            ReloadRefused: the version did not load or failed its check (the old one serves).
        """
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._reload())
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return await asyncio.shield(self._task)

    def _refused(self, reason: str) -> ReloadRefused:
        metrics.MODEL_RELOADS.labels(outcome="refused").inc()
        log.error("model.reload_refused", reason=reason, serving=self.serving.as_dict() if self.serving else None)
        return ReloadRefused(reason)

    async def _reload(self) -> ModelVersion:
        engines = self.cfg.engines_path
        read = read_manifest(engines)
        if read is None:
            raise self._refused(f"{engines / MANIFEST_FILE} missing or unreadable (a preparation still writing it?)")
        self._tried = read[0]
        log.info("model.reload_started", version=read[0][:12], engines_dir=str(engines))
        try:
            reference = load_reference(engines, read[1])
            encoder = await open_encoder(self.cfg.inference, engines, log_setup=LOG_SETUP)
        except Exception as exc:  # noqa: BLE001 - whatever stops the load, the old model keeps serving
            raise self._refused(f"did not load: {exc}") from None
        try:
            report = await run_probe(encoder, reference, encoder.variant.rpartition("/")[2])
            if not report["passed"]:
                raise self._refused(report.get("reason") or f"parity probe failed: min cosine {report['min_cosine']} "
                                    f"< {report['threshold']} over {report['texts']} texts "
                                    f"(worst: {report['worst_text']!r})")
            async with self.lock:
                d = self.dispatcher
                retriever, head, fit = await derive(self.cfg, d.kb, encoder, model_digest(self.cfg, read[1]))
                retriever.mode = d.retriever.mode
                old = d.retriever.encoder
                d.retriever, d.head, d.topic_fit = retriever, head, fit  # the swap: one step (module doc)
        except BaseException as exc:
            await encoder.close()
            if isinstance(exc, ReloadRefused) or not isinstance(exc, Exception):  # refused, or cancelled
                raise
            # the probe or the derived data failed: the old model keeps serving
            raise self._refused(f"{type(exc).__name__}: {exc}") from None
        before, now = self.serving, _version(read, encoder.variant)
        self._serve(now)
        metrics.MODEL_RELOADS.labels(outcome="swapped").inc()
        log.info("model.swapped", **now.as_dict(), old=before.as_dict() if before else None,
                 probe_min_cosine=report["min_cosine"])
        await self._drain(old)
        return now

    async def _drain(self, old: Any) -> None:
        """Wait for the messages begun on the old model, then close its encoder."""
        try:
            await asyncio.wait_for(asyncio.shield(self.dispatcher.once.drain()), DRAIN_TIMEOUT_S)
        except TimeoutError:
            log.warning("model.drain_timed_out", timeout_s=DRAIN_TIMEOUT_S, effect="closing the old encoder anyway")
        finally:
            cache = getattr(old, "cache", None)
            if cache is not None:
                cache.clear()
            await old.close()

    async def watch(self, interval_s: float) -> None:
        """Reload whenever the manifest's sha256 changes, checking every ``interval_s`` seconds,
        forever (cancel the task to stop). A refused version is not tried again until the
        manifest changes again (or ``healthbot engine reload``); a manifest put back to the
        version serving is not reloaded."""
        while True:
            await asyncio.sleep(interval_s)
            read = read_manifest(self.cfg.engines_path)
            if read is None or read[0] == self._tried or (self.serving and read[0][:12] == self.serving.version):
                continue
            try:
                await self.reload()
            except ReloadRefused:
                pass  # logged and counted
            except Exception:  # noqa: BLE001 - never let the watcher die: the old model keeps serving
                log.exception("model.reload_failed")

    async def close(self) -> None:
        """Stop a reload in progress (shutdown); a new encoder not yet swapped in is closed."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def setup_admin(app: web.Application, token: str, reloader: ModelReloader) -> None:
    """``POST`` :data:`RELOAD_PATH` on ``app``: 200 ``{"swapped": true, "model": {version,
    model_digest, engine}}`` once the new version serves; 422 ``{"error", "model"}`` when it was
    refused (the old ``model`` serves); 401 without ``Authorization: Bearer <token>``; 404 while
    ``token`` is empty."""

    async def reload_engine(request: web.Request) -> web.Response:
        if not token:
            return json_error(404, "the admin API is off: set HEALTHBOT_SERVER_ADMIN_TOKEN to use it")
        if not bearer_ok(request, token):
            log.warning("admin.unauthorized", path=request.path, remote=request.remote)
            return json_error(401, "missing or wrong admin token",
                              headers={"WWW-Authenticate": 'Bearer realm="healthbot-admin"'})
        try:
            version = await reloader.reload()
        except ReloadRefused as exc:
            return json_error(422, f"new model refused, the old one keeps serving: {exc.reason}",
                              model=reloader.serving.as_dict() if reloader.serving else None)
        return web.json_response({"swapped": True, "model": version.as_dict()})

    app.router.add_post(RELOAD_PATH, reload_engine)


async def request_reload(cfg: Config, url: str | None = None, timeout_s: float = 900.0) -> int:
    """``healthbot engine reload``: ask the running server at ``url`` (default
    ``http://server.host:server.port``) to load its engines folder's model now, with
    ``server.admin_token``; print the outcome. Returns the exit status: 0 swapped, 1 refused,
    2 not asked (no token, server unreachable, token rejected)."""
    if not cfg.server.admin_token:
        print("healthbot: set HEALTHBOT_SERVER_ADMIN_TOKEN (the server's server.admin_token)", file=sys.stderr)
        return 2
    host = "127.0.0.1" if cfg.server.host in ("", "0.0.0.0", "::") else cfg.server.host
    base = (url or f"http://{host}:{cfg.server.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {cfg.server.admin_token}"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.post(base + RELOAD_PATH, headers=headers) as resp:
                status, body = resp.status, await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        print(f"healthbot: no answer from {base}{RELOAD_PATH}: {exc}", file=sys.stderr)
        return 2
    if status == 200:
        print(f"swapped: now serving {json.dumps(body['model'])}")
        return 0
    print(f"healthbot: {status}: {body.get('error')}", file=sys.stderr)
    return 1 if status == 422 else 2
