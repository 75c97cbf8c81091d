"""End to end on a GPU host: ``healthbot serve --processes N`` under ``healthbot loadtest --generators``
(issue 23), with the encoder on the GPU (torch_cuda behind one engine server) and on the CPU
(ONNX Runtime in every front-end process), one host, one call.

Two steps, because neither the prepared model (448 MiB) nor this project's Python dependencies
are on the GPU machine, and at most 64 MiB travel:

``python tools/e2e_bench.py pack [--out .e2e]``
    on the development machine. Writes ``.e2e/`` (git-ignored, about 45 MiB): the encoder's
    matrices as INT8 with one FP32 scale per output row and its vectors FP32 (``weights.npz``,
    the key layout of tools/gpu_bench.py plus ``q:``/``s:`` keys), the embedding rows of every
    token the server embeds at start (knowledge base, intent examples, decision and topic-fit
    training lines, the load test's questions: found by running the start-up derivation with a
    recording encoder) in FP16, the tokenizer, and the wheels of the dependencies the GPU image
    lacks (``whl/``; jieba without its unused analysers, ``jieba.tgz``), and this machine's
    ``redis-server`` with the libraries a stock Ubuntu image lacks (``redis/``, 3.1 MiB;
    tools/e2e_redis.py). The serving model on the GPU host is therefore not bit-identical to
    the released one (INT8 weights), but it is self-consistent: the knowledge base, the decision
    head and the topic-fit verifier are all derived there from the same weights, as ``healthbot
    serve`` does at a first start. Speed, which is what this measures, does not depend on the
    weights' values.

``python tools/e2e_bench.py run --out DIR [--layouts gpu,cpu,gpu-redis,cpu-redis] [--seconds 15]``
    on the GPU machine, from the repository root, with ``PYTHONPATH=.e2e/site:.`` after the
    wheels are installed there (the command line in docs/loadtest.md). Materializes ``engines/``
    from the carry (tools/gpu_bench.py), starts one ``serve`` per encoder to derive and cache
    the knowledge base's vectors and the learned models, then per layout starts ``serve --processes N``
    (store shared by the processes: the SQLite file, or for ``*-redis`` a fresh carried
    ``redis-server`` on loopback, skipped if it does not start), sends open-loop steps at rising
    rates from several generator processes, and writes ``e2e.json`` (each layout's store) and
    ``e2e.log`` under ``--out``. ``nvidia-smi`` samples the GPU's load during each step, Redis's
    ``INFO`` its CPU and commands per message.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN, APPID = "e2e-token", "wx0123456789abcdef"
JIEBA_KEEP = ("jieba/__init__.py", "jieba/__main__.py", "jieba/_compat.py", "jieba/dict.txt", "jieba/finalseg/")


# =========================================================================== pack (CPU)
def used_token_ids(engines_dir: Path) -> list[int]:
    """Every token id the server embeds at a first start, and the load test's questions'."""
    import asyncio

    from bot.config import load_config
    from bot.knowledge import load_knowledge_base
    from bot.loadtest.traffic import QUESTIONS
    from bot.runtime import derive
    from inference.tokenizer import E5Tokenizer

    texts: list[tuple[str, str]] = [("query: ", q) for q in QUESTIONS]

    class Recording:
        """An encoder that remembers what it is asked and answers random unit vectors."""
        variant, dim, engine_name = "recording/none", 384, "recording"

        async def encode(self, batch: list[str], prefix: str = "query: ") -> np.ndarray:
            texts.extend((prefix, t) for t in batch)
            v = np.random.default_rng(len(texts)).standard_normal((len(batch), self.dim)).astype(np.float32)
            return v / np.linalg.norm(v, axis=1, keepdims=True)

    cfg = load_config()
    with tempfile.TemporaryDirectory() as tmp:
        cfg.inference.engines_dir = tmp  # the recording's caches go nowhere that lasts
        asyncio.run(derive(cfg, load_knowledge_base(cfg.kb_path), Recording(), "recording"))
    tok = E5Tokenizer.load(engines_dir)
    ids = {0, 1, 2, 3}
    for prefix, text in texts:
        for window in tok.encode_batch([text], prefix=prefix)[0]:
            ids.update(window)
    print(f"{len(texts)} texts embedded at start, {len(ids)} token ids", file=sys.stderr)
    return sorted(ids)


def pack(engines_dir: Path, out: Path, wheels: Path) -> None:
    from inference.engines.torch_cuda.weights import bert_from_onnx
    from inference.tokenizer import E5Tokenizer
    from tools.e2e_redis import pack_redis
    from tools.gpu_bench import write_carry

    out.mkdir(parents=True, exist_ok=True)
    used = np.array(used_token_ids(engines_dir), dtype=np.int64)
    bert = bert_from_onnx(engines_dir / "model.onnx")
    state = {k: v.detach().numpy() for k, v in bert.state_dict().items() if "position_ids" not in k}
    word = state.pop("embeddings.word_embeddings.weight")
    arrays = {"word_ids": used, "word_rows": word[used].astype(np.float16)}
    for k, v in state.items():
        if v.ndim == 2:
            scale = np.maximum(np.abs(v).max(axis=1, keepdims=True), 1e-12) / 127.0
            arrays["q:" + k] = np.round(v / scale).astype(np.int8)
            arrays["s:" + k] = scale.astype(np.float32)
        else:
            arrays["w:" + k] = v.astype(np.float32)
    write_carry(out, engines_dir, bert, E5Tokenizer.load(engines_dir).pad_id, arrays, rows_carried=int(used.size),
                matrices="int8, a scale per output row")
    whl = out / "whl"
    whl.mkdir(exist_ok=True)
    for f in sorted(wheels.glob("*.whl")):
        if f.name.startswith("jieba-"):
            _slim_jieba(f, out / "jieba.tgz")
        else:
            shutil.copy2(f, whl / f.name)
    redis_bytes = pack_redis(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"packed {used.size} embedding rows, {len(state)} tensors and {len(list(whl.iterdir()))} wheels into {out} "
          f"({size / 2**20:.1f} MiB, redis-server and its libraries {redis_bytes / 2**20:.1f} MiB of it)",
          file=sys.stderr)


def _slim_jieba(wheel: Path, dest: Path) -> None:
    import zipfile
    with zipfile.ZipFile(wheel) as z, tarfile.open(dest, "w:gz") as tar, tempfile.TemporaryDirectory() as tmp:
        for name in z.namelist():
            if name.startswith(JIEBA_KEEP):
                tar.add(z.extract(name, tmp), arcname=name)


# =========================================================================== run (GPU host)
class Log:
    def __init__(self, out: Path) -> None:
        self.path = out / "e2e.log"

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _ready(port: int, timeout_s: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def _serve(env: dict[str, str], port: int, processes: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bot.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--processes", str(processes)]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _gpu_sampler(out: Path, label: str) -> subprocess.Popen | None:
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                             "-lms", "500"], stdout=open(out / f"gpu-{label}.csv", "w"), stderr=subprocess.DEVNULL)


def _gpu_busy(out: Path, label: str) -> float | None:
    try:
        rows = [line.split(",") for line in (out / f"gpu-{label}.csv").read_text().splitlines() if line.strip()]
        return round(sum(float(r[0]) for r in rows) / len(rows), 1) if rows else None
    except (OSError, ValueError):
        return None


CPU = {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "onnxruntime"}
LAYOUTS = {
    # label: (environment, front-end processes, store: "sqlite" the shared file, "redis" a fresh local server)
    "gpu": ({}, 12, "sqlite"),
    "gpu-nocache": ({"HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "0"}, 12, "sqlite"),
    "gpu-si": ({"HEALTHBOT_INFERENCE_SWITCH_INTERVAL_MS": "0.5"}, 12, "sqlite"),
    "gpu-redis": ({}, 12, "redis"),
    "gpu-redis-nocache": ({"HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "0"}, 12, "redis"),
    "cpu": (CPU, 12, "sqlite"),
    "cpu-nocache": (dict(CPU, HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE="0"), 12, "sqlite"),
    "cpu-redis": (CPU, 12, "redis"),
    "cpu-redis-nocache": (dict(CPU, HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE="0"), 12, "redis"),
}


def _profile(master: int, out: Path, label: str, seconds: float) -> list[subprocess.Popen]:
    """``py-spy record`` (all threads, idle samples kept) of the two busiest front-end processes,
    starting once the step is under way."""
    import psutil
    spy = shutil.which("py-spy") or next((str(p) for p in (REPO / ".e2e/site/bin/py-spy",
                                                            Path(sys.executable).parent / "py-spy") if p.exists()), None)
    if spy is None:
        return []
    time.sleep(START_S)
    kids = [p for p in psutil.Process(master).children() if "engine_server" not in " ".join(p.cmdline())]
    for p in kids:
        p.cpu_percent(None)
    time.sleep(1.0)
    busiest = sorted(kids, key=lambda p: -p.cpu_percent(None))[:2]
    return [subprocess.Popen([spy, "record", "--idle", "--threads", "-r", "100", "-f", "raw", "-d",
                              str(max(int(seconds) - 3, 2)), "-o", str(out / f"pyspy-{label}-{i}.txt"), "-p",
                              str(p.pid)], stdout=subprocess.DEVNULL, stderr=open(out / "pyspy.err", "a"))
            for i, p in enumerate(busiest)]


#: Seconds from a step's start (its generators spawning) to the profile's start.
START_S = 6.0


def _encoder(label: str) -> str:
    """The encoder a layout serves with: ``onnxruntime`` (the cpu* layouts) or ``default`` (the GPU's)."""
    return LAYOUTS[label][0].get("HEALTHBOT_INFERENCE_ENGINE_ORDER", "default")


def _first_starts(layouts: list[str], base: dict[str, str], out: Path, log: Log) -> None:
    """One single-process ``serve`` per encoder the layouts use, one after the other: each derives
    and caches the knowledge base's vectors and the learned models for its encoder (on an H100
    host 204 s for the GPU's, 259 s for ONNX Runtime's; started together, neither was ready after
    480 s), which every front-end process then loads."""
    for i, engine in enumerate(dict.fromkeys(_encoder(label) for label in layouts)):
        env_over = {"HEALTHBOT_INFERENCE_ENGINE_ORDER": engine} if engine != "default" else {}
        port, started = 18800 + i, time.monotonic()
        proc = _serve(dict(base, HEALTHBOT_DATA_DIR=tempfile.mkdtemp(), **env_over), port, 1,
                      out / f"serve-first-{engine}.log")
        ok = _ready(port, 420, proc)
        log(f"first start of the {engine} encoder (derives and caches the knowledge base's vectors and the "
            f"learned models): ready={ok} after {time.monotonic() - started:.0f} s; exit {_stop(proc)}")


def run(out: Path, layouts: list[str], rates: list[float], seconds: float, warmup: float, generators: int,
        processes: int | None, device: str, profile_rate: float | None = None,
        cpu_rates: list[float] | None = None) -> None:
    from redis.exceptions import RedisError

    from tools.e2e_redis import RedisServer, step_figures
    from tools.gpu_bench import materialize_engines_dir

    out.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    t0 = time.monotonic()
    carry = REPO / ".e2e"
    engines = REPO / "engines" if device == "cpu" else materialize_engines_dir(carry)
    log(f"engines in {engines} ({time.monotonic() - t0:.0f} s); cores {os.cpu_count()}")
    base = dict(os.environ, PYTHONUNBUFFERED="1", HEALTHBOT_WECHAT_TOKEN=TOKEN, HEALTHBOT_WECHAT_APPID=APPID,
                HEALTHBOT_INFERENCE_ENGINES_DIR=str(engines), HEALTHBOT_ADMISSION_MAX_CONNECTIONS_PER_ADDRESS="0")
    results: dict = {"cores": os.cpu_count(), "layouts": {}}
    port = 18931
    _first_starts(layouts, base, out, log)
    for label in layouts:
        env_over, n, store = LAYOUTS[label]
        n = processes or n
        redis = RedisServer.start(carry / "redis", out / f"redis-{label}.log", log) if store == "redis" else None
        if store == "redis" and redis is None:
            log(f"{label}: skipped, no Redis server")
            results["layouts"][label] = {"processes": n, "env": env_over, "store": "redis", "skipped": "see e2e.log"}
            (out / "e2e.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
            continue
        data_dir = tempfile.mkdtemp()
        store_url = redis.url if redis else f"sqlite:///{data_dir}/healthbot.db"  # bot/config.py's default
        env = dict(base, HEALTHBOT_DATA_DIR=data_dir, **env_over)
        if redis:
            env["HEALTHBOT_STORE_URL"] = redis.url
        if redis:
            try:
                redis.client.flushall()  # the measured server starts on an empty store
                store = f"redis {redis.version()}"
            except RedisError as e:
                log(f"{label}: skipped, Redis stopped answering after the first start: {e}; exit {redis.stop()}")
                continue
        port += 1
        srv = _serve(env, port, n, out / f"serve-{label}.log")
        started = time.monotonic()
        if not _ready(port, 240, srv):
            log(f"{label}: not ready after {time.monotonic() - started:.0f} s (exit {srv.poll()})")
            _stop(srv)
            if redis:
                redis.stop()
            continue
        log(f"{label}: {n} front-end processes ready in {time.monotonic() - started:.0f} s; {env_over}; {store} "
            f"store {store_url}" + (f" ({redis.binary})" if redis else ""))
        steps = []
        for rate in (cpu_rates or rates) if _encoder(label) == "onnxruntime" else rates:
            gpu = _gpu_sampler(out, f"{label}-{rate:g}")
            cmd = [sys.executable, "-m", "bot.cli", "--log-level", "WARNING", "loadtest", "--url",
                   f"http://127.0.0.1:{port}", "--rate", str(rate), "--seconds", str(seconds), "--warmup",
                   str(warmup), "--generators", str(generators), "--server-pid", str(srv.pid), "--json"]
            redis0 = redis.stats() if redis else None
            test = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            spies = _profile(srv.pid, out, f"{label}-{rate:g}", seconds - warmup) if rate == profile_rate else []
            stdout, stderr = test.communicate(timeout=seconds + 120)
            proc = subprocess.CompletedProcess(cmd, test.returncode, stdout, stderr)
            if gpu is not None:
                gpu.terminate()
                gpu.wait()
            for spy in spies:
                spy.wait(timeout=30)
            try:
                s = json.loads(proc.stdout)
            except ValueError:
                log(f"  {label} {rate:g}/s: no result (exit {proc.returncode}): {proc.stderr[-800:]}")
                break
            s["gpu_busy_percent"] = _gpu_busy(out, f"{label}-{rate:g}")
            if redis:
                s.update(step_figures(redis0, redis.stats(), s["sent"]))
            steps.append(s)
            log(f"  {label} {rate:g}/s: answered {s['answered_rps']}/s p50 {s['p50_ms']} p99 {s['p99_ms']} "
                f"p99.9 {s['p99_9_ms']} ms, errors {s['errors']}, deferred {s['deferred']}, not answers "
                f"{s['not_answers']}, server CPU {s['cpu_ms_per_msg']} ms/msg (front ends {s['front_end_cpu_ms_per_msg']}, "
                f"encoder's processes {s['encoder_cpu_ms_per_msg']}), generators {s['client_cpu_ms_per_msg']} "
                f"ms/msg, GPU busy {s['gpu_busy_percent']} %" + (f", Redis CPU {s['redis_cpu_ms_per_msg']} ms/msg "
                f"over {s['redis_commands_per_msg']} commands/msg" if redis else ""))
            if s["errors"] or s["p99_ms"] > 1000 or s["answered_rps"] < 0.9 * rate:
                break  # past saturation: the next rate only queues more
            time.sleep(2.0)
        results["layouts"][label] = {"processes": n, "env": env_over, "store": store, "store_url": store_url,
                                     "steps": steps, "exit": _stop(srv), "store_exit": redis.stop() if redis else None}
        (out / "e2e.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    log(f"done in {time.monotonic() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--engines-dir", type=Path, default=REPO / "engines")
    p.add_argument("--out", type=Path, default=REPO / ".e2e")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels downloaded for the GPU image's Python")
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--layouts", default="gpu,cpu")
    r.add_argument("--rates", default="500,1000,2000,3000,4000,5000")
    r.add_argument("--cpu-rates", help="the rates of the cpu* layouts (ONNX Runtime) when not --rates")
    r.add_argument("--seconds", type=float, default=15.0)
    r.add_argument("--warmup", type=float, default=3.0)
    r.add_argument("--generators", type=int, default=4)
    r.add_argument("--processes", type=int, help="front-end processes (default: each layout's)")
    r.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: a smoke test of this script here")
    r.add_argument("--profile-rate", type=float, help="py-spy the two busiest front-end processes during this rate")
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(a.engines_dir, a.out, a.wheels)
    else:
        run(a.out, a.layouts.split(","), [float(x) for x in a.rates.split(",")], a.seconds, a.warmup, a.generators,
            a.processes, a.device, a.profile_rate,
            [float(x) for x in a.cpu_rates.split(",")] if a.cpu_rates else None)


if __name__ == "__main__":
    main()
