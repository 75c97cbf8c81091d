"""Fuzzing every input route on loopback (issue 21): any 5xx, or any line logged at error level
or with a traceback, fails.

Routes: ``/wechat`` in plaintext and safe mode (signed and unsigned requests; real
wechatpy crypto on the server, the independent signer of tests/wechat_client.py here),
``/telegram`` (mutations of real update shapes, with the secret), ``POST /api/chat``,
the agent console's API and ``GET /api/messages`` — all in one server
(tests/abuse_stack.py) running on its own event loop in a thread, since Hypothesis
drives a synchronous test body.

Bounded in time: ``HEALTHBOT_FUZZ_EXAMPLES`` examples per route (default 200: about
1,400 requests, 9 s for all five on 2 cores); ``HEALTHBOT_FUZZ_EXAMPLES=2000`` gives
the issue's run of over 10,000 inputs. No example database is written
(``database=None``). ``pytest -s`` prints each route's count of answers by status.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections import Counter
from typing import Any, Callable, Coroutine
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests import abuse_stack as ab
    from tests import wechat_client as wx
except ImportError:  # pragma: no cover
    import abuse_stack as ab  # type: ignore[no-redef]
    import wechat_client as wx  # type: ignore[no-redef]

EXAMPLES = int(os.environ.get("HEALTHBOT_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


class LoopThread:
    """An event loop running in a thread; :meth:`run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def env():
    """(loop thread, {"plaintext": Stack, "safe": Stack})."""
    runner = LoopThread()
    stacks = {mode: runner.run(ab.start_stack(mode)) for mode in ("plaintext", "safe")}
    yield runner, stacks
    for stack in stacks.values():
        runner.run(stack.close())
    runner.stop()


class Recorder:
    """Answers seen during one test: every 5xx with what caused it."""

    def __init__(self) -> None:
        self.server_errors: list[str] = []
        self.statuses: Counter[int] = Counter()

    @property
    def count(self) -> int:
        return sum(self.statuses.values())

    def check(self, status: int, what: Any) -> None:
        self.statuses[status] += 1
        if status >= 500:
            self.server_errors.append(f"{status} for {str(what)[:300]}")


@pytest.fixture
def fuzz(env):
    """``(run, stacks, recorder)``; fails the test on any 5xx or problem log line, checked at the end."""
    runner, stacks = env
    recorder = Recorder()
    with ab.LogWatch() as watch:
        yield runner.run, stacks, recorder
        runner.run(stacks["plaintext"].telegram.idle())
        runner.run(asyncio.sleep(0.2))  # late WeChat deliveries and Telegram sends finish
    print(f"fuzz: {recorder.count} requests, statuses {dict(sorted(recorder.statuses.items()))}")  # shown with -s
    assert recorder.server_errors == [], recorder.server_errors[:5]
    assert watch.found() == [], watch.found()[:5]
    assert recorder.count >= 1


# --------------------------------------------------------------------------- building blocks


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, chosen in proportion to its weight (most inputs should get past the
    first checks, so the deeper code is fuzzed too)."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


TEXT = st.text(max_size=60)
ID_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), TEXT)
JSON = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


def cdata(text: str) -> str:
    return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"


XML_NAME = st.sampled_from(["a", "b", "Content", "MsgId", "xml", "Recognition", "item", "Encrypt"])
XML_TREE = st.recursive(
    TEXT.map(cdata) | st.sampled_from(["", "1", "9" * 40, "&amp;", "&lt;b&gt;", "&#0;", "&x;"]),
    lambda inner: st.builds(lambda tag, kids: f"<{tag}>{''.join(kids)}</{tag}>", XML_NAME,
                            st.lists(inner, max_size=3)),
    max_leaves=10)
FIELD_VALUE = st.one_of(TEXT.map(cdata), XML_TREE, st.integers().map(str),
                        st.integers(min_value=1, max_value=3000).map(lambda n: "<a>" * n + "</a>" * n))
MSG_TYPE = st.sampled_from(["text", "voice", "image", "event", "location", "link", "file", "video", "foo", ""])
EVENT = st.sampled_from(["subscribe", "unsubscribe", "CLICK", "VIEW", "SCAN", "LOCATION", "", "x" * 300])
FIELD = st.sampled_from(["ToUserName", "FromUserName", "CreateTime", "MsgType", "Content", "MsgId", "Event",
                         "EventKey", "Recognition", "MediaId", "Format", "Location_X", "ScanCodeInfo"])


@st.composite
def wechat_message(draw: Callable[..., Any]) -> str:
    """A WeChat message XML with some of its fields replaced, repeated or dropped."""
    fields: dict[str, str] = {"ToUserName": cdata(wx.ACCOUNT), "FromUserName": cdata(wx.USER),
                              "CreateTime": str(int(time.time())), "MsgType": cdata(draw(MSG_TYPE)),
                              "Content": cdata(draw(TEXT)), "Event": cdata(draw(EVENT)),
                              "Recognition": cdata(draw(TEXT)), "MsgId": str(draw(st.integers(0, 2**64)))}
    for name in draw(st.lists(FIELD, max_size=3)):
        fields[name] = draw(FIELD_VALUE)
    for name in draw(st.lists(FIELD, max_size=2)):
        fields.pop(name, None)
    body = "".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
    body += "".join(f"<{k}>{v}</{k}>" for k in draw(st.lists(FIELD, max_size=1)) for v in [draw(FIELD_VALUE)])
    return f"<xml>{body}</xml>"


WECHAT_XML = weighted((8, wechat_message()), (1, XML_TREE), (1, XML_TREE.map(lambda t: f"<xml>{t}</xml>")),
                     (1, st.integers(0, 3000).map(lambda n: "<xml>" + "<a>" * n + "</a>" * n + "</xml>")), (1, TEXT))
TIMESTAMP = weighted((8, st.just("now")), (1, st.integers(-(10**20), 10**20).map(str)), (1, st.text(max_size=20)),
                     (1, st.integers(1, 6000).map(lambda n: "9" * n)))
SIGNED = st.sampled_from([True, True, True, False])
NO_RAW = weighted((9, st.none()), (1, st.binary(max_size=300)))


def _ts(value: str) -> str:
    return str(int(time.time())) if value == "now" else value


# --------------------------------------------------------------------------- WeChat


@FUZZ
@given(ts=TIMESTAMP, nonce=HEADER_TEXT, signed=SIGNED, xml=WECHAT_XML, raw=NO_RAW,
       extra=st.dictionaries(HEADER_TEXT, TEXT, max_size=2))
def test_fuzz_wechat_plaintext(fuzz, ts, nonce, signed, xml, raw, extra):
    run, stacks, rec = fuzz
    stack = stacks["plaintext"]
    ts = _ts(ts)
    q = {**extra, "timestamp": ts, "nonce": nonce,
         "signature": wx.sign(ab.WECHAT_TOKEN, ts, nonce) if signed else "0" * 40}
    body = raw if raw is not None else xml.encode("utf-8", "surrogatepass")
    for method in ("POST", "GET"):
        query = dict(q, echostr=xml[:50]) if method == "GET" else q
        status, _ = run(stack.request(method, "/wechat?" + urlencode(query), data=body if method == "POST" else None))
        rec.check(status, (method, query, body[:200]))


@FUZZ
@given(ts=TIMESTAMP, nonce=HEADER_TEXT, mode=st.sampled_from(["signed"] * 6 + ["unsigned", "garbage"]),
       xml=WECHAT_XML, envelope_extra=weighted((6, st.just("")), (1, XML_TREE),
                                               (1, st.integers(1, 5000).map(lambda n: "<a>" * n + "</a>" * n))))
def test_fuzz_wechat_safe_mode(fuzz, ts, nonce, mode, xml, envelope_extra):
    run, stacks, rec = fuzz
    stack = stacks["safe"]
    ts = _ts(ts)
    enc = wx.encrypt(stack.signer.aes_key, ab.APPID, xml) if mode != "garbage" else "QUJD" * 20
    msg_signature = wx.sign(ab.WECHAT_TOKEN, ts, nonce, enc) if mode != "unsigned" else "f" * 40
    q = {"timestamp": ts, "nonce": nonce, "encrypt_type": "aes", "msg_signature": msg_signature}
    body = f"<xml>{envelope_extra}<Encrypt><![CDATA[{enc}]]></Encrypt></xml>".encode("utf-8", "surrogatepass")
    status, answer = run(stack.request("POST", "/wechat?" + urlencode(q), data=body))
    rec.check(status, (q, body[:200]))
    status, _ = run(stack.request("GET", "/wechat?" + urlencode({**q, "echostr": enc})))
    rec.check(status, ("GET", q))


# --------------------------------------------------------------------------- Telegram

USER = st.integers(1, 2**40)
_UPDATE_IDS = itertools.count(1_000_000)


@st.composite
def telegram_update(draw: Callable[..., Any]) -> Any:
    """A real update shape (text, command, callback, group, media, edit, member change, agents'
    topic), then up to three mutations inside it: a value replaced by any JSON, or a key dropped
    (and, rarely, ``update_id`` replaced)."""
    u = ab.Updates(bot_id=123456, bot_username="healthbot_test_bot")
    user = draw(USER)
    text = draw(st.one_of(TEXT, st.sampled_from(["/start", "/help", "/human", "/stop", "/lang", "/lang en",
                                                 "/lang zh", "/nope", "/help@healthbot_test_bot", "1"])))
    kind = draw(st.sampled_from(["text", "callback", "group", "sticker", "edited", "member", "topic"]))
    update: Any = {
        "text": lambda: u.text(user, text),
        "callback": lambda: u.callback(user, draw(st.one_of(TEXT, st.sampled_from(["lang:zh", "lang:en"])))),
        "group": lambda: u.group_text(-100 - user, user, text, mention=draw(st.booleans())),
        "sticker": lambda: u.sticker(user),
        "edited": lambda: u.edited(user, text, 1),
        "member": lambda: u.my_chat_member(user, draw(st.sampled_from(["kicked", "member", "left", "x"]))),
        "topic": lambda: u.topic_message(ab.AGENT_CHAT, user, draw(st.integers(1, 10**6)), text),
    }[kind]()
    update["update_id"] = next(_UPDATE_IDS)  # a fresh id: a repeated one would be dropped as a re-delivery
    payload = next(key for key in update if key != "update_id")
    if "text" in update[payload] and draw(st.booleans()):  # entities anywhere, also inside an emoji
        update[payload]["entities"] = [{"type": draw(st.sampled_from(["mention", "bot_command", "text_mention"])),
                                        "offset": draw(st.integers(-2, 12)), "length": draw(st.integers(-1, 30))}]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        node, key = _random_slot(draw, update[payload])
        if key is None:
            break
        if draw(st.booleans()):
            node[key] = draw(JSON)
        elif isinstance(node, dict):
            node.pop(key, None)
    if draw(st.sampled_from([False] * 19 + [True])):  # (integers() would favour 0, the boundary)
        update["update_id"] = draw(JSON)
    return update


def _random_slot(draw: Callable[..., Any], node: Any) -> tuple[Any, Any]:
    """A (container, key) somewhere inside ``node``, chosen by ``draw``."""
    parent, key = None, None
    while isinstance(node, (dict, list)) and node:
        keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        if not draw(st.booleans()):
            break
        node = node[key]
    return parent, key


@FUZZ
@given(update=weighted((9, telegram_update()), (1, JSON)), raw=NO_RAW)
def test_fuzz_telegram(fuzz, update, raw):
    run, stacks, rec = fuzz
    stack = stacks["plaintext"]
    body = raw if raw is not None else json.dumps(update).encode("utf-8", "surrogatepass")
    status, _ = run(stack.request("POST", "/telegram", data=body, headers=ab.telegram_headers()))
    rec.check(status, body[:300])


# --------------------------------------------------------------------------- HTTP API and console

CHAT_FIELD = st.sampled_from(["text", "user_id", "message_id", "lang"])
CHAT_VALUE = st.one_of(JSON_LEAF, st.sampled_from(["zh", "en", "人工", "失眠怎么办"]), st.text(min_size=1999,
                                                                                             max_size=2001))
CONTENT_TYPE = st.sampled_from(["application/json", "application/json; charset=foo", "text/plain",
                                "application/json; charset=latin-1", "multipart/form-data"])


@FUZZ
@given(body=weighted((6, st.fixed_dictionaries({"text": TEXT}, optional={"user_id": CHAT_VALUE,
                                                                         "message_id": CHAT_VALUE,
                                                                         "lang": CHAT_VALUE})),
                     (2, st.dictionaries(CHAT_FIELD, CHAT_VALUE, max_size=4)), (1, JSON)),
       raw=weighted((12, st.none()), (1, st.binary(max_size=200)),
                    (1, st.integers(1, 60_000).map(lambda n: b"[" * n + b"]" * n)),
                    (1, st.integers(4000, 6000).map(lambda n: b'{"text": ' + b"7" * n + b"}"))),
       content_type=CONTENT_TYPE)
def test_fuzz_api_chat(fuzz, body, raw, content_type):
    run, stacks, rec = fuzz
    stack = stacks["plaintext"]
    data = raw if raw is not None else json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    status, _ = run(stack.request("POST", "/api/chat", data=data, headers={"Content-Type": content_type}))
    rec.check(status, data[:300])


REF = weighted((4, st.just("REAL")), (2, st.text(max_size=30).map(lambda t: quote(t, safe=""))),
               (1, st.text(alphabet="0123456789abcdef", min_size=24, max_size=24)))
AUTH = weighted((6, st.just("REAL")), (1, HEADER_TEXT), (1, HEADER_TEXT.map(lambda t: "Bearer " + t)), (1, st.none()))


@FUZZ
@given(action=st.sampled_from(["list", "show", "reply", "close", "messages", "page"]), ref=REF, auth=AUTH,
       body=weighted((1, JSON), (4, st.fixed_dictionaries({"text": CHAT_VALUE}))), raw=NO_RAW,
       content_type=CONTENT_TYPE, user_id=ID_TEXT,
       wait=st.sampled_from(["0", "-1", "nan", "inf", "x", "26", "0.01", "1e999", ""]))
def test_fuzz_console_api(fuzz, action, ref, auth, body, raw, content_type, user_id, wait):
    run, stacks, rec = fuzz
    stack = stacks["plaintext"]
    ref = stack.ref if ref == "REAL" and action != "close" else ("0" * 24 if ref == "REAL" else ref)
    headers = {"Content-Type": content_type}
    if auth is not None:
        headers["Authorization"] = ab.console_headers()["Authorization"] if auth == "REAL" else auth
    data = raw if raw is not None else json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    method, path, kw = {
        "list": ("GET", "/console/api/handoffs", {}),
        "show": ("GET", f"/console/api/handoffs/{ref}", {}),
        "reply": ("POST", f"/console/api/handoffs/{ref}/reply", {"data": data}),
        "close": ("POST", f"/console/api/handoffs/{ref}/close", {}),
        "messages": ("GET", "/api/messages?" + urlencode({"user_id": user_id, "wait": wait}), {}),
        "page": ("GET", f"/console/static/{ref}", {}),
    }[action]
    if action == "messages":
        headers.pop("Authorization", None)
    status, _ = run(stack.request(method, path, headers=headers, **kw))
    rec.check(status, (action, path, headers, data[:200]))
