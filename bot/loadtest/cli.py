"""``healthbot loadtest``: what the subcommand runs (its options are wired in bot/cli.py).

Closed loop (no ``--rate``): :func:`bot.loadtest.traffic.run_loadtest`, as before. Open loop
(``--rate R``): :func:`bot.loadtest.openloop.run_open_loop`, or with ``--ramp``
:func:`bot.loadtest.openloop.run_ramp`. ``--start-server`` runs ``healthbot serve`` for the
run (bot/loadtest/cpu.py) and measures its CPU; ``--server-pid`` measures a running one's.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_command"]


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _global_args(args: argparse.Namespace) -> list[str]:
    out = ["--log-level", args.log_level]
    if getattr(args, "config", None):
        out[:0] = ["--config", args.config]
    return out


async def run_command(cfg: Any, args: argparse.Namespace) -> int:
    """Run ``healthbot loadtest`` with the parsed ``args`` against ``cfg`` (bot.config.Config); the exit status."""
    from bot.loadtest.cpu import start_server

    server = None
    token = cfg.wechat.token
    try:
        if args.start_server:
            env = {}
            if not token and args.channel == "wechat":
                token = env["HEALTHBOT_WECHAT_TOKEN"] = "loadtest" + secrets.token_hex(8)
            server = await start_server(_global_args(args), env, progress=_say)
            args.url, args.server_pid = server.url, server.pid
        url = args.url or f"http://{cfg.server.host}:{cfg.server.port}"
        if args.rate is None:
            return await _closed(cfg, args, url, token)
        return await _open(cfg, args, url, token)
    except (ValueError, RuntimeError) as exc:
        print(f"healthbot loadtest: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            status = await server.stop()
            _say(f"  stopped healthbot serve (exit status {status}); its log: {server.log}")


async def _closed(cfg: Any, args: argparse.Namespace, url: str, token: str) -> int:
    from bot.loadtest import LoadtestConfig, format_markdown, format_report, run_loadtest, write_plot
    run = LoadtestConfig(url=url, users=args.users, seconds=args.seconds, channel=args.channel,
                         max_requests=args.max_requests, think_ms=args.think_ms, token=token,
                         appid=cfg.wechat.appid, aes_key=cfg.wechat.aes_key, mode=cfg.wechat.mode,
                         telegram_secret=cfg.telegram.secret)
    result = await run_loadtest(run, progress=_say)
    print(json.dumps(result.summary(), ensure_ascii=False) if args.json else format_report(result))
    if args.plot:
        _say(f"plot: {write_plot(result, args.plot)}")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(result), encoding="utf-8")
    return 1 if result.summary()["errors"] else 0


async def _open(cfg: Any, args: argparse.Namespace, url: str, token: str) -> int:
    from bot.loadtest.generators import run_generators
    from bot.loadtest.open_report import format_open, format_open_markdown, format_ramp, write_ramp_plot
    from bot.loadtest.openloop import OpenLoopConfig, run_ramp
    from bot.loadtest.report import write_plot
    run = OpenLoopConfig(url=url, rate=args.rate, seconds=args.seconds, arrivals=args.arrivals,
                         warmup_s=args.warmup, channel=args.channel, token=token, appid=cfg.wechat.appid,
                         aes_key=cfg.wechat.aes_key, mode=cfg.wechat.mode, telegram_secret=cfg.telegram.secret,
                         server_pid=args.server_pid)
    def send(c: OpenLoopConfig, progress: Any = None) -> Any:
        return run_generators(c, args.generators, progress)

    if args.ramp:
        ramp = await run_ramp(run, step=args.ramp_step or args.rate, max_rate=args.ramp_max or 20 * args.rate,
                              p99_ms=args.p99_ms, progress=_say, run=send)
        if args.json:
            print(json.dumps({"p99_bound_ms": ramp.p99_ms, "best_rate": ramp.best_rate,
                              "steps": [r.summary() for r in ramp.steps]}, ensure_ascii=False))
        else:
            print(format_ramp(ramp))
        if args.plot:
            _say(f"plot: {write_ramp_plot(ramp, args.plot)}")
        if args.markdown:
            Path(args.markdown).write_text(format_ramp(ramp, markdown=True), encoding="utf-8")
        return 0 if ramp.best_rate is not None else 1
    result = await send(run, progress=_say)
    s = result.summary()
    print(json.dumps(s, ensure_ascii=False) if args.json else format_open(result))
    if args.plot:
        title = (f"healthbot loadtest, open loop — {s['arrivals']} arrivals at {s['offered_rps']:g}/s, "
                 f"{s['requests']} messages; p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, {s['errors']} errors")
        _say(f"plot: {write_plot(result, args.plot, title=title)}")  # type: ignore[arg-type]
    if args.markdown:
        Path(args.markdown).write_text(format_open_markdown(result), encoding="utf-8")
    return 1 if s["errors"] else 0
