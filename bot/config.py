"""One validated configuration object: TOML file + ``HEALTHBOT_*`` environment overrides.

Triton-style: every serving knob lives here with a documented default and is
validated at start-up; no other module reads the environment. Secrets (WeChat
token, AES key and AppSecret, Telegram token and secret, the console, metrics and admin tokens)
come only from the environment.

Environment overrides: ``HEALTHBOT_<SECTION>_<KEY>`` (e.g.
``HEALTHBOT_INFERENCE_MAX_QUEUE_DELAY_MS=5``), plus the documented short names
``HEALTHBOT_WECHAT_TOKEN``, ``HEALTHBOT_WECHAT_APPID``, ``HEALTHBOT_WECHAT_AES_KEY``,
``HEALTHBOT_WECHAT_APPSECRET``.

Relative paths (``data_dir``, ``inference.engines_dir``, ``knowledge.kb_dir``) resolve
against one base folder (:func:`base_dir`): the source checkout when the package runs
from one (``make serve``, ``make test``, ``python -m bot.cli``: ``engines/`` and ``data/``
in the checkout), else the user's data folder from platformdirs
(``~/.local/share/healthbot`` on Linux, ``$XDG_DATA_HOME/healthbot`` when that is set),
never the installed package. Absolute paths are used as they are, e.g.
``HEALTHBOT_DATA_DIR=/srv/healthbot/data``.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from bot.decision import DecisionConfig
from inference.config import ConfigError, InferenceConfig
from safety.config import SafetyConfig

#: The folder above the package: the source checkout when running from one (tests use it).
REPO_ROOT = Path(__file__).resolve().parent.parent


def base_dir() -> Path:
    """The folder relative paths resolve against: :data:`REPO_ROOT` when it is a source checkout
    (its ``pyproject.toml`` beside the ``bot`` package), else the user data folder
    ``platformdirs.user_data_dir("healthbot")`` (``~/.local/share/healthbot`` on Linux), so an
    installed package never writes into site-packages."""
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT
    return Path(platformdirs.user_data_dir("healthbot", appauthor=False))


@dataclass
class ServerConfig:
    """HTTP server. ``host``/``port``: listening address (loopback by default).

    ``shutdown_timeout_s``: bound on graceful shutdown, seconds from SIGTERM to exit
    (stop accepting, finish in-flight replies, drain the batcher; bot/app.py
    ``serve``). Keep it below the platform's kill delay (Kubernetes'
    ``terminationGracePeriodSeconds`` defaults to 30 s, Docker's ``stop`` to 10 s);
    the default 8 s fits Docker's and covers WeChat's 4 s ``reply_budget_s`` drain.

    ``metrics_port``: serve ``GET /metrics`` on this port of ``host`` alone (0 = on ``port``,
    beside the API). ``metrics_token``: the bearer token every scrape must send (secret,
    ``HEALTHBOT_SERVER_METRICS_TOKEN``; at least 16 characters); empty = open
    (bot/metrics_endpoint.py). ``admin_token``: the bearer token of the admin API (secret,
    ``HEALTHBOT_SERVER_ADMIN_TOKEN``; at least 16 characters): ``POST
    /api/v1/admin/engine/reload`` and ``healthbot engine reload`` (bot/model_reload.py); empty =
    the admin API is off (404).

    ``processes`` (``healthbot serve --processes N``, ``HEALTHBOT_SERVER_PROCESSES``): front-end
    processes on this host (bot/prefork.py). 1 (the default) = one process, as before; N ≥ 2 = a
    master process that starts N, each a whole front end on the same ``host:port``
    (``SO_REUSEPORT``), restarts one that dies and drains them all on SIGTERM; 0 = auto, the
    CPU cores this process may use, minus one when a GPU engine server runs (1 on one core).
    N ≥ 2 needs a store the processes share (the SQLite default or Redis, not ``memory://``).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 64 * 1024  # larger webhook bodies get 413
    #: Per-user token bucket: sustained messages per minute and burst (a polite "slow down" beyond).
    user_rate_per_minute: float = 20.0
    user_burst: int = 8
    shutdown_timeout_s: float = 8.0
    metrics_port: int = 0
    metrics_token: str = ""
    admin_token: str = ""
    processes: int = 1


#: Shortest accepted ``server.metrics_token`` and ``server.admin_token``, characters (e.g.
#: ``openssl rand -hex 24`` gives 48).
MIN_METRICS_TOKEN_CHARS = 16


@dataclass
class WechatConfig:
    """WeChat official account (https://developers.weixin.qq.com/doc/offiaccount/).

    ``mode``: ``plaintext`` | ``compatible`` | ``safe`` (AES message encryption).
    ``reply_budget_s``: time the webhook waits for an answer before giving up on a
    passive reply; WeChat itself waits 5 s (see adapters/wechat/constants.py).
    ``timestamp_window_s``: requests whose ``timestamp`` is further from now are
    rejected as replays. ``account_type``: ``service`` (late answers go out through
    the customer-service API; needs ``appsecret``) or ``subscription`` (late answers
    wait for the user's next message). ``appsecret``: for the server API (access
    token), secret, only from ``HEALTHBOT_WECHAT_APPSECRET``. ``api_base``: server
    API base URL (tests point it at a fake). ``kf_account``: customer-service
    account (``name@wxid``) that handoffs go to; empty = any agent.
    ``api_timeout_s``: per server-API call, seconds. ``feedback_menu``: answers sent through the
    customer-service API are followed by a 👍 / 👎 menu message (``msgmenu``, bot/feedback.py);
    service accounts only, off by default.
    """

    token: str = ""
    appid: str = ""
    aes_key: str = ""
    mode: str = "plaintext"
    account_type: str = "subscription"
    reply_budget_s: float = 4.0
    timestamp_window_s: int = 300
    appsecret: str = ""
    api_base: str = "https://api.weixin.qq.com"
    kf_account: str = ""
    api_timeout_s: float = 5.0
    feedback_menu: bool = False


@dataclass
class TelegramConfig:
    """Telegram bot (python-telegram-bot v22; Bot API https://core.telegram.org/bots/api).

    ``token``: the bot token (secret, ``HEALTHBOT_TELEGRAM_TOKEN``). ``secret``: the
    webhook secret token compared with ``X-Telegram-Bot-Api-Secret-Token``
    (``HEALTHBOT_TELEGRAM_SECRET``). ``api_base``: Bot API base URL (tests point it
    at a local fake server). ``agent_chat``: the agents' forum supergroup id for
    human handoff (0 = none). ``webhook_url``: public URL for ``telegram set-webhook``.
    """

    token: str = ""
    secret: str = ""
    api_base: str = "https://api.telegram.org/bot"
    agent_chat: int = 0
    webhook_url: str = ""


@dataclass
class ConsoleConfig:
    """Agent console (adapters/console.py): ``GET /console`` and its ``/console/api/*``.

    ``token``: the agents' shared bearer token (secret, ``HEALTHBOT_CONSOLE_TOKEN``);
    empty = the console is off (its API answers 404). At least 16 characters.
    """

    token: str = ""


@dataclass
class KnowledgeConfig:
    """Knowledge base and retrieval.

    ``kb_dir``: folder of topic YAML files (default: the packaged ``bot/kb``).
    ``min_confidence``: below this calibrated confidence the intent is ``no_answer``.
    ``reload_interval_s``: how often the server checks the files for edits (0 = never).
    ``record_unanswered``: keep the questions answered with no_answer or refer_doctor, personal
    data masked and without any user id, for ``healthbot report unanswered`` (bot/unanswered.py);
    off by default (``HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED``). ``unanswered_retention_days``:
    how long they are kept, days (each day's list expires that long after the day ends).
    """

    kb_dir: str = ""
    min_confidence: float = 0.5
    reload_interval_s: float = 2.0
    record_unanswered: bool = False
    unanswered_retention_days: int = 30


@dataclass
class AdmissionConfig:
    """Admission control (bot/admission/): who gets how much of this process; everything per process,
    in memory. Rates are per minute, bursts the bucket's size; tokens are *estimated* encoder tokens
    (:func:`bot.admission.estimate_tokens`).

    ``max_question_tokens``: a longer question is read as its beginning and its end (half each),
    and the reply says so. ``user_tokens_per_minute`` / ``user_token_burst``: each user's work
    budget (WeChat, Telegram, HTTP); beyond it, a polite "please wait" without encoding.
    ``address_per_minute`` / ``address_burst`` and ``address_tokens_per_minute`` /
    ``address_token_burst``: requests and work per client address on ``POST /api/chat``
    (beyond: 429 with ``Retry-After``). ``failure_per_minute`` / ``failure_burst``: 4xx answers an
    address gets before each further one is held ``failure_delay_s`` seconds.
    ``max_connections``: open connections in all (0 = the file-descriptor limit minus a reserve of
    256); ``max_connections_per_address`` (0 = no cap per address). ``header_timeout_s`` /
    ``body_timeout_s``: a request header (else the connection is closed) and body (else 408) must
    arrive within this; ``keepalive_timeout_s``: aiohttp's idle time between requests.
    ``trusted_proxies``: addresses or networks whose ``X-Forwarded-For`` is believed (a reverse
    proxy in front; comma-separated in the environment).
    """

    #: 80 estimated tokens are at most about 60 real ones (Chinese, English; less with many
    #: digits): the encoder's 64-token bucket, about twice a short question's cost (a window in
    #: the 128 bucket cost 3-4 times as much, measured); 211 of 220 real public health
    #: questions are shorter and pass unchanged.
    max_question_tokens: int = 80
    user_tokens_per_minute: float = 480.0
    user_token_burst: float = 320.0
    address_per_minute: float = 300.0
    address_burst: float = 120.0
    address_tokens_per_minute: float = 3000.0
    address_token_burst: float = 2000.0
    failure_per_minute: float = 60.0
    failure_burst: float = 30.0
    failure_delay_s: float = 1.0
    max_connections: int = 0
    max_connections_per_address: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    trusted_proxies: tuple[str, ...] = ()


@dataclass
class Config:
    """The whole effective configuration."""

    server: ServerConfig = field(default_factory=ServerConfig)
    wechat: WechatConfig = field(default_factory=WechatConfig)
    telegram: TelegramConfig = field(default_factory=TelegramConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    knowledge: KnowledgeConfig = field(default_factory=KnowledgeConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    decision: DecisionConfig = field(default_factory=DecisionConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    data_dir: str = "data"
    #: ``sqlite:///path.db`` (default: ``<data_dir>/healthbot.db``), ``redis://host:port/db`` or ``memory://``.
    store_url: str = ""

    def path(self, value: str) -> Path:
        """A configured path, absolute as it is, relative against :func:`base_dir`."""
        p = Path(value)
        return p if p.is_absolute() else base_dir() / p

    @property
    def effective_store_url(self) -> str:
        """``store_url``, or the embedded default SQLite file under the data directory."""
        return self.store_url or f"sqlite:///{self.path(self.data_dir) / 'healthbot.db'}"

    @property
    def engines_path(self) -> Path:
        """The prepared model's folder (``inference.engines_dir`` resolved by :meth:`path`)."""
        return self.path(self.inference.engines_dir)

    @property
    def kb_path(self) -> Path:
        return self.path(self.knowledge.kb_dir) if self.knowledge.kb_dir else Path(__file__).parent / "kb"


_SECRET_ENV = {
    "HEALTHBOT_WECHAT_TOKEN": ("wechat", "token"),
    "HEALTHBOT_WECHAT_APPID": ("wechat", "appid"),
    "HEALTHBOT_WECHAT_AES_KEY": ("wechat", "aes_key"),
    "HEALTHBOT_WECHAT_APPSECRET": ("wechat", "appsecret"),
    "HEALTHBOT_TELEGRAM_TOKEN": ("telegram", "token"),
    "HEALTHBOT_TELEGRAM_SECRET": ("telegram", "secret"),
    "HEALTHBOT_TELEGRAM_API_BASE": ("telegram", "api_base"),
    "HEALTHBOT_TELEGRAM_AGENT_CHAT": ("telegram", "agent_chat"),
    "HEALTHBOT_CONSOLE_TOKEN": ("console", "token"),
}
_SECRET_KEYS = {("wechat", "token"), ("wechat", "aes_key"), ("wechat", "appsecret"), ("telegram", "token"),
                ("telegram", "secret"), ("console", "token"), ("server", "metrics_token"), ("server", "admin_token")}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _to_bool(value: Any) -> bool:
    """A boolean setting from TOML or the environment; raises ValueError for anything but
    true/false, 1/0, yes/no, on/off (any case), so a typo does not silently mean false."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("use true or false")


def _coerce(section: str, key: str, current: Any, value: Any) -> Any:
    name = f"{section}.{key}" if section else key
    try:
        if isinstance(current, bool):
            return _to_bool(value)
        if isinstance(current, int) and not isinstance(current, bool):
            return int(value)
        if isinstance(current, float):
            return float(value)
        if isinstance(current, (list, tuple)):
            items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
            return type(current)(items)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {name!r}: bad value {value!r} ({exc})") from None


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    target = getattr(cfg, section) if section else cfg
    names = {f.name for f in dataclasses.fields(target)}
    if key not in names:
        name = f"{section}.{key}" if section else key
        close = difflib.get_close_matches(key, sorted(names), n=1)
        hint = f" (did you mean '{section + '.' if section else ''}{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{name}'{hint}")
    setattr(target, key, _coerce(section, key, getattr(target, key), value))


def _validate(cfg: Config) -> None:
    if cfg.wechat.mode not in ("plaintext", "compatible", "safe"):
        raise ConfigError(f"config key 'wechat.mode': {cfg.wechat.mode!r} is not plaintext|compatible|safe")
    if cfg.wechat.account_type not in ("subscription", "service"):
        raise ConfigError(f"config key 'wechat.account_type': {cfg.wechat.account_type!r} is not subscription|service")
    if cfg.wechat.feedback_menu and cfg.wechat.account_type != "service":
        raise ConfigError("config key 'wechat.feedback_menu': needs wechat.account_type 'service' (subscription "
                          "accounts have no customer-service API to send the menu with)")
    if cfg.wechat.mode != "plaintext" and len(cfg.wechat.aes_key) != 43:
        raise ConfigError("config key 'wechat.aes_key': the EncodingAESKey must be 43 characters in compatible/safe mode")
    inf = cfg.inference
    inf.validate()
    for key in ("max_batch_size", "max_queue_size", "workers", "max_batch_tokens"):
        if getattr(inf, key) < 1:
            raise ConfigError(f"config key 'inference.{key}': must be >= 1")
    if inf.max_queue_delay_ms < 0 or inf.deadline_ms <= 0:
        raise ConfigError("config key 'inference.max_queue_delay_ms' must be >= 0 and 'inference.deadline_ms' > 0")
    _validate_server(cfg.server)
    if not 0.0 < cfg.wechat.reply_budget_s < 5.0:
        raise ConfigError("config key 'wechat.reply_budget_s': must be between 0 and 5 s (WeChat waits 5 s)")
    if not 0.0 <= cfg.knowledge.min_confidence <= 1.0:
        raise ConfigError("config key 'knowledge.min_confidence': must be in [0, 1]")
    if not 1 <= cfg.knowledge.unanswered_retention_days <= 3650:
        raise ConfigError("config key 'knowledge.unanswered_retention_days': must be 1-3650 days")
    for f in dataclasses.fields(cfg.decision):
        if not 0.0 <= getattr(cfg.decision, f.name) <= 1.0:
            raise ConfigError(f"config key 'decision.{f.name}': must be a probability in [0, 1]")
    if cfg.decision.danger_net > cfg.decision.danger_full:
        raise ConfigError("config key 'decision.danger_net': must not exceed 'decision.danger_full'")
    _validate_admission(cfg.admission)


def _validate_server(server: ServerConfig) -> None:
    if server.shutdown_timeout_s <= 0:
        raise ConfigError("config key 'server.shutdown_timeout_s': must be > 0 seconds")
    if server.processes < 0:
        raise ConfigError("config key 'server.processes': must be >= 0 (1 = one process, 0 = one per CPU core)")
    for key in ("port", "metrics_port"):
        if not 0 <= getattr(server, key) <= 65535:
            raise ConfigError(f"config key 'server.{key}': must be a TCP port, 0-65535")
    if server.metrics_port and server.metrics_port == server.port:
        raise ConfigError("config key 'server.metrics_port': must differ from 'server.port' (0 = serve /metrics "
                          "on server.port)")
    for key in ("metrics_token", "admin_token"):
        if getattr(server, key) and len(getattr(server, key)) < MIN_METRICS_TOKEN_CHARS:
            raise ConfigError(f"config key 'server.{key}': at least {MIN_METRICS_TOKEN_CHARS} characters "
                              "(e.g. openssl rand -hex 24)")


def _validate_admission(adm: AdmissionConfig) -> None:
    for f in dataclasses.fields(adm):
        value = getattr(adm, f.name)
        if f.name == "trusted_proxies":
            for entry in value:
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ConfigError(f"config key 'admission.trusted_proxies': {entry!r} is not an address "
                                      "or network") from None
        elif f.name in ("max_connections", "max_connections_per_address", "failure_delay_s"):
            if value < 0:
                raise ConfigError(f"config key 'admission.{f.name}': must be >= 0")
        elif value <= 0:
            raise ConfigError(f"config key 'admission.{f.name}': must be > 0")
    if adm.max_question_tokens < 16:
        raise ConfigError("config key 'admission.max_question_tokens': must be >= 16 (a short question must fit)")


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the effective config: defaults < TOML file < environment < ``overrides``.

    Args:
        path: optional TOML file; ``HEALTHBOT_CONFIG`` in ``env`` is used if None.
        env: environment mapping (default ``os.environ``).
        overrides: dotted keys (``"server.port"``) set last, e.g. from CLI flags.

    Raises:
        ConfigError: unknown key or invalid value, naming the key.
    """
    env = os.environ if env is None else env
    cfg = Config()
    path = path or env.get("HEALTHBOT_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        for section, body in data.items():
            if isinstance(body, dict):
                if section not in {f.name for f in dataclasses.fields(cfg)}:
                    raise ConfigError(f"unknown config section {section!r}")
                for key, value in body.items():
                    if (section, key) in _SECRET_KEYS:
                        raise ConfigError(f"config key '{section}.{key}' is a secret: set it in the environment")
                    _apply(cfg, section, key, value)
            else:
                _apply(cfg, "", section, body)
    sections = {f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    for name, value in env.items():
        if name in _SECRET_ENV:
            _apply(cfg, *_SECRET_ENV[name], value)
        elif name.startswith("HEALTHBOT_") and name not in ("HEALTHBOT_CONFIG",):
            rest = name[len("HEALTHBOT_"):].lower()
            section, _, key = rest.partition("_")
            if section in sections and key:
                _apply(cfg, section, key, value)
            elif rest in ("data_dir", "store_url"):
                _apply(cfg, "", rest, value)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.rpartition(".")
        _apply(cfg, section, key, value)
    _validate(cfg)
    return cfg


def redacted(cfg: Config) -> dict[str, Any]:
    """The config as a dict with secrets replaced by ``"***"`` (for logs and ``config show``)."""
    out = dataclasses.asdict(cfg)
    for section, key in _SECRET_KEYS:
        if out[section][key]:
            out[section][key] = "***"
    return out
