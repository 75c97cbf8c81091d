"""The versioned HTTP API and its OpenAPI 3.1 document (issue 25), on a real ``healthbot serve`` on loopback.

* the document (adapters/openapi.json) passes ``openapi-spec-validator``, is what the server serves at
  ``GET /api/v1/openapi.json``, and names every ``/api/v1`` route the app has;
* schemathesis fuzzes every operation of the document against the server (valid and invalid
  requests, wrong methods, missing auth): no 5xx, every status, header, content type and body as
  documented;
* the cases the fuzzer may miss are sent by hand and each answer validated with jsonschema against
  the document's schema for that operation and status: bad JSON, missing and wrong fields, bodies
  over the limit (declared and chunked, 60-200 KB), wrong methods, unknown paths, the console's
  handoff flow (list, show, reply, close), the probes; and the old paths answer as the v1 ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from adapters.http import OPENAPI_FILE
from tests.conftest import requires_model
from tests.servers import ServeProcess

pytestmark = [pytest.mark.model, requires_model]

CONSOLE_TOKEN = "console-token-for-api-v1-tests-0123"
AUTH = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}
START_TIMEOUT_S = 180.0
#: Examples per operation and generation mode (valid, invalid) in the schemathesis run.
FUZZ_EXAMPLES = 25
#: A generated long poll (``wait``) longer than this is shortened to it, seconds: the fuzzer
#: would otherwise spend up to 25 s on each.
FUZZ_MAX_WAIT_S = 0.1

DOC: dict[str, Any] = json.loads(OPENAPI_FILE.read_text(encoding="utf-8"))
_REGISTRY = Registry().with_resource("urn:healthbot-openapi", Resource.from_contents(DOC, DRAFT202012))


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    """``healthbot serve`` with the console and the admin API on and the per-address budgets out of the
    fuzzer's way."""
    env = {**os.environ, "HEALTHBOT_CONSOLE_TOKEN": CONSOLE_TOKEN,
           # the admin API on, with a token the fuzzer does not send (it never starts a model reload)
           "HEALTHBOT_SERVER_ADMIN_TOKEN": "admin-token-for-api-v1-tests-0123",
           "HEALTHBOT_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0",
           # thousands of 4xx from one address: none held, none refused with 429
           "HEALTHBOT_ADMISSION_FAILURE_BURST": "1000000", "HEALTHBOT_ADMISSION_FAILURE_PER_MINUTE": "1000000",
           "HEALTHBOT_ADMISSION_ADDRESS_BURST": "1000000", "HEALTHBOT_ADMISSION_ADDRESS_PER_MINUTE": "1000000",
           "HEALTHBOT_ADMISSION_ADDRESS_TOKEN_BURST": "1e9", "HEALTHBOT_ADMISSION_ADDRESS_TOKENS_PER_MINUTE": "1e9",
           "HEALTHBOT_SERVER_USER_BURST": "1000000", "HEALTHBOT_SERVER_USER_RATE_PER_MINUTE": "1000000"}
    for name in ("HEALTHBOT_STORE_URL", "HEALTHBOT_SERVER_METRICS_PORT", "HEALTHBOT_SERVER_METRICS_TOKEN"):
        env.pop(name, None)
    server = ServeProcess(env, tmp_path_factory.mktemp("log") / "serve.log", name="api server")
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def response_schema(path: str, method: str, status: int, media: str = "application/json") -> dict:
    """The document's schema for ``method path``'s ``status`` answer (a ``$ref`` into the document)."""
    responses = DOC["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} does not document {status}"
    pointer = f"#/paths/{path.replace('~', '~0').replace('/', '~1')}/{method.lower()}/responses/{status}"
    response = responses[str(status)]
    if "$ref" in response:
        pointer = response["$ref"]
        response = DOC["components"]["responses"][pointer.rsplit("/", 1)[1]]
    assert media in response["content"], f"{method} {path} {status}: no {media} body documented"
    return {"$ref": f"urn:healthbot-openapi{pointer}/content/{media.replace('/', '~1')}/schema"}


async def check(resp: aiohttp.ClientResponse, path: str, method: str, status: int) -> Any:
    """Assert ``resp`` has ``status``, a JSON body valid against the document for it, and an
    ``X-Request-Id``; return the body."""
    text = await resp.text()
    assert resp.status == status, f"{method} {path}: {resp.status} {text[:300]}"
    assert resp.content_type == "application/json", f"{method} {path}: {resp.content_type} {text[:200]}"
    assert resp.headers.get("X-Request-Id")
    body = json.loads(text)
    Draft202012Validator(response_schema(path, method, status), registry=_REGISTRY).validate(body)
    return body


# --------------------------------------------------------------------------- the document


def test_the_document_is_valid_openapi_3_1():
    assert DOC["openapi"].startswith("3.1.")
    validate_openapi(DOC)  # raises OpenAPIValidationError with the offending place


def test_every_error_answer_is_documented_as_json_with_an_error_field():
    for path, item in DOC["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if int(status) < 400 or path == "/readyz":  # /readyz's 503 is its readiness body
                    continue
                schema = response_schema(path, method, int(status))
                Draft202012Validator(schema, registry=_REGISTRY).validate({"error": "x", "retry": True,
                                                                           "user_id": "u", "message_id": "m"})
                with pytest.raises(Exception):
                    Draft202012Validator(schema, registry=_REGISTRY).validate({"message": "x"})


def test_the_document_names_every_versioned_route_of_the_app():
    from bot.app import create_app
    from bot.config import load_config

    app = create_app(load_config(env={"HEALTHBOT_CONSOLE_TOKEN": CONSOLE_TOKEN}))  # routes only: nothing starts
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"
              and (r.resource.canonical.startswith("/api/v1/") or r.resource.canonical in ("/healthz", "/readyz",
                                                                                          "/metrics"))}
    documented = {(method, path) for path, item in DOC["paths"].items() for method in item}
    assert routes == documented


# --------------------------------------------------------------------------- schemathesis

SCHEMA = schemathesis.openapi.from_path(OPENAPI_FILE)
SCHEMA.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                                max_examples=FUZZ_EXAMPLES)
# examples: the document's own; coverage: boundary values of every schema (2000 and 2001 characters,
# 0 and 25 s, missing and wrong-typed fields); fuzzing: random valid and invalid requests.
SCHEMA.config.phases.update(phases=["examples", "coverage", "fuzzing"])


def _short_long_poll(case) -> None:
    """A valid ``wait`` over :data:`FUZZ_MAX_WAIT_S` becomes that (an invalid one is left to be refused)."""
    query = case.query or {}
    try:
        wait = float(query.get("wait", 0))
    except (TypeError, ValueError):
        return
    if FUZZ_MAX_WAIT_S < wait <= 25:
        query["wait"] = FUZZ_MAX_WAIT_S


@SCHEMA.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_every_operation_answers_as_its_document_says(case, api_server):
    """No 5xx, and every answer (status, headers, content type, body) as documented, for valid and
    invalid requests; with schemathesis' own checks (wrong methods get 405, requests without the
    console token 401, invalid data 4xx)."""
    _short_long_poll(case)
    case.call_and_validate(base_url=api_server.base, headers=AUTH, timeout=30)


# --------------------------------------------------------------------------- chat, by hand

CHAT = "/api/v1/chat"


async def test_chat_answers_and_the_old_path_is_an_alias(api_server, http):
    user = f"v1-{uuid.uuid4().hex}"
    async with http.post(api_server.base + CHAT, json={"text": "失眠怎么办", "user_id": user}) as resp:
        v1 = await check(resp, CHAT, "post", 200)
    assert v1["user_id"] == user and v1["reply"]
    async with http.post(api_server.base + "/api/chat", json={"text": "失眠怎么办", "user_id": user}) as resp:
        old = await check(resp, CHAT, "post", 200)
    assert (old["user_id"], old["intent"], old["topic"]) == (user, v1["intent"], v1["topic"])
    async with http.post(api_server.base + CHAT, json={"text": "hello", "lang": None, "user_id": None}) as resp:
        anon = await check(resp, CHAT, "post", 200)
    assert anon["user_id"].startswith("anon-")


@pytest.mark.parametrize("body,needle", [
    (b'{"text": "unterminated', "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"[1, 2]", "JSON object"),
    (b'{"user_id": "u1"}', "'text'"),
    (b'{"text": 42}', "'text'"),
    (json.dumps({"text": "x" * 2001}).encode(), "2000"),
    (b'{"text": "hi", "lang": "fr"}', "'lang'"),
    (json.dumps({"text": "hi", "user_id": "u" * 129}).encode(), "user_id"),
    (b'{"text": "hi", "message_id": true}', "message_id"),
    (b"", "not valid JSON"),
])
async def test_bad_chat_requests_get_a_documented_400(api_server, http, body, needle):
    async with http.post(api_server.base + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
        error = await check(resp, CHAT, "post", 400)
    assert needle in error["error"]


@pytest.mark.parametrize("kilobytes", [65, 100, 200, 1000])
async def test_a_body_over_the_limit_gets_a_json_413_declared_or_chunked(api_server, http, kilobytes):
    """Issue 25: 60-200 KB bodies used to get aiohttp's plain-text 413 (the whole body had arrived
    with the header, so the middleware's declared-length check was skipped)."""
    body = b'{"text": "' + b"a" * (kilobytes * 1024) + b'"}'
    async with http.post(api_server.base + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
        error = await check(resp, CHAT, "post", 413)
    assert "65536 bytes" in error["error"]

    async def chunks():
        for i in range(0, len(body), 16 * 1024):
            yield body[i:i + 16 * 1024]

    async with http.post(api_server.base + CHAT, data=chunks(), headers={"Content-Type": "application/json"}) as resp:
        error = await check(resp, CHAT, "post", 413)
    assert "65536 bytes" in error["error"]


async def test_a_body_just_under_the_limit_is_read(api_server, http):
    body = json.dumps({"text": "睡不着", "padding": "a" * (60 * 1024)}).encode()
    async with http.post(api_server.base + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
        await check(resp, CHAT, "post", 200)


@pytest.mark.parametrize("method,path,allowed", [
    ("GET", CHAT, "POST"), ("PUT", CHAT, "POST"), ("DELETE", "/api/chat", "POST"),
    ("POST", "/api/v1/messages", "GET"), ("POST", "/healthz", "GET"), ("PATCH", "/api/v1/openapi.json", "GET"),
])
async def test_a_wrong_method_gets_a_json_405_with_allow(api_server, http, method, path, allowed):
    async with http.request(method, api_server.base + path) as resp:
        assert resp.status == 405 and resp.content_type == "application/json"
        assert allowed in resp.headers["Allow"]
        error = await resp.json()
    Draft202012Validator({"$ref": "urn:healthbot-openapi#/components/schemas/Error"},
                         registry=_REGISTRY).validate(error)
    assert method in error["error"]


@pytest.mark.parametrize("path", ["/api/v2/chat", "/api/v1/nothing", "/nowhere", "/console/api/other"])
async def test_an_unknown_path_gets_a_json_404(api_server, http, path):
    async with http.get(api_server.base + path) as resp:
        assert resp.status == 404 and resp.content_type == "application/json"
        assert (await resp.json())["error"]


# --------------------------------------------------------------------------- messages and the console


async def test_messages_and_its_errors(api_server, http):
    path, base = "/api/v1/messages", api_server.base
    async with http.get(base + path, params={"user_id": f"nobody-{uuid.uuid4().hex}"}) as resp:
        assert await check(resp, path, "get", 200) == {"messages": [], "handoff": False}
    for params in ({}, {"user_id": "u", "wait": "abc"}, {"user_id": "u", "wait": "26"}, {"user_id": "u" * 129}):
        async with http.get(base + path, params=params) as resp:
            await check(resp, path, "get", 400)
    async with http.get(base + "/api/messages", params={"user_id": "nobody"}) as resp:  # the alias
        await check(resp, path, "get", 200)


async def test_the_console_api_under_v1_through_a_whole_handoff(api_server, http):
    base, handoffs = api_server.base, "/api/v1/console/handoffs"
    one, reply, close = handoffs + "/{ref}", handoffs + "/{ref}/reply", handoffs + "/{ref}/close"
    async with http.get(base + handoffs) as resp:
        assert "Bearer" in resp.headers["WWW-Authenticate"]
        await check(resp, handoffs, "get", 401)
    user = f"hf-{uuid.uuid4().hex}"
    async with http.post(base + CHAT, json={"text": "转人工", "user_id": user}) as resp:
        assert (await check(resp, CHAT, "post", 200))["intent"] == "handoff"
    async with http.get(base + handoffs, headers=AUTH) as resp:
        listed = await check(resp, handoffs, "get", 200)
    (mine,) = [h for h in listed["handoffs"] if h["channel"] == "http" and h["label"].endswith(user[-4:])]
    async with http.get(base + "/console/api/handoffs", headers=AUTH) as resp:  # the page's own path
        assert mine in (await check(resp, handoffs, "get", 200))["handoffs"]
    ref = mine["ref"]
    async with http.get(base + one.format(ref=ref), headers=AUTH) as resp:
        shown = await check(resp, one, "get", 200)
    assert shown["ref"] == ref and isinstance(shown["transcript"], list)
    async with http.post(base + reply.format(ref=ref), headers=AUTH, json={"text": "   "}) as resp:
        await check(resp, reply, "post", 400)
    async with http.post(base + reply.format(ref=ref), headers=AUTH, data=b"x" * (70 * 1024)) as resp:
        await check(resp, reply, "post", 413)
    async with http.post(base + reply.format(ref=ref), headers=AUTH, json={"text": "您好，我在。"}) as resp:
        assert await check(resp, reply, "post", 200) == {"ok": True}
    async with http.get(base + "/api/v1/messages", params={"user_id": user}) as resp:
        got = await check(resp, "/api/v1/messages", "get", 200)
    assert [(m["from"], m["text"]) for m in got["messages"]] == [("agent", "您好，我在。")] and got["handoff"]
    async with http.post(base + close.format(ref=ref), headers=AUTH) as resp:
        assert await check(resp, close, "post", 200) == {"ok": True}
    for path, method in ((one, "get"), (close, "post")):
        async with http.request(method, base + path.format(ref=ref), headers=AUTH) as resp:
            await check(resp, path, method, 404)


# --------------------------------------------------------------------------- probes and the document


async def test_probes_metrics_and_the_served_document(api_server, http):
    async with http.get(api_server.base + "/healthz") as resp:
        assert await check(resp, "/healthz", "get", 200) == {"status": "ok"}
    async with http.get(api_server.base + "/readyz") as resp:
        assert (await check(resp, "/readyz", "get", 200))["ready"] is True
    async with http.get(api_server.base + "/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        assert "healthbot_" in await resp.text()
    async with http.get(api_server.base + "/api/v1/openapi.json") as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        assert await resp.read() == OPENAPI_FILE.read_bytes()


async def test_errors_from_concurrent_bad_requests_stay_json(api_server, http):
    """A burst of mixed junk at once: every answer is a documented JSON 4xx, none a 5xx."""
    bodies = [b"{", b"[]", b'{"text": null}', b"\x00" * 10, b'{"text": "' + b"a" * 70000 + b'"}'] * 6

    async def one(body: bytes) -> int:
        async with http.post(api_server.base + CHAT, data=body) as resp:
            assert resp.content_type == "application/json"
            assert (await resp.json())["error"]
            return resp.status

    statuses = await asyncio.gather(*(one(b) for b in bodies))
    assert set(statuses) == {400, 413}


def test_the_document_file_is_the_one_the_package_ships():
    assert OPENAPI_FILE == Path(__file__).resolve().parent.parent / "adapters" / "openapi.json"
