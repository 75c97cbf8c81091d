"""Shape checks of a Telegram update before python-telegram-bot sees it (issue 21).

python-telegram-bot's ``Update.de_json`` trusts the Bot API: it does not check
types, so ``"text": 5``, a chat id of ``"abc"`` or an entity ``length`` of ``"z"``
become objects that fail later, deep inside a handler, with a traceback (about
450 of them in the issue's fuzz run). Telegram itself never sends such updates;
whoever does holds the webhook secret or is testing. :func:`update_problem`
checks the fields this adapter and its handoff relay read — for the update types
it subscribes to (:data:`~adapters.telegram.constants.ALLOWED_UPDATES`) — and
says what is wrong, so the webhook can log one warning line and drop the update.

Every other field is left to python-telegram-bot (a failure there is logged as a
warning too, see :meth:`adapters.telegram.TelegramAdapter._accept`).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["INT_BOUND", "update_problem"]

INT_BOUND = 2**63
"""Integers (ids, dates, offsets) must lie strictly within ±this: the Bot API's ids fit 64
bits ("at most 52 significant bits"), and a larger ``date`` overflows ``datetime``."""

# A spec: field name -> (expected, required); expected is a type, a nested spec (dict),
# or a one-element list holding the spec of each item.
_USER: dict[str, Any] = {"id": (int, True), "is_bot": (bool, True), "first_name": (str, True),
                         "username": (str, False), "language_code": (str, False)}
_CHAT: dict[str, Any] = {"id": (int, True), "type": (str, True), "title": (str, False), "username": (str, False),
                         "is_forum": (bool, False)}
_ENTITY: dict[str, Any] = {"type": (str, True), "offset": (int, True), "length": (int, True), "user": (_USER, False)}
_MESSAGE_CORE: dict[str, Any] = {
    "message_id": (int, True), "date": (int, True), "chat": (_CHAT, True), "from": (_USER, False),
    "text": (str, False), "caption": (str, False), "entities": ([_ENTITY], False),
    "caption_entities": ([_ENTITY], False), "message_thread_id": (int, False), "is_topic_message": (bool, False),
    "edit_date": (int, False),
}
_MESSAGE: dict[str, Any] = {**_MESSAGE_CORE, "reply_to_message": (_MESSAGE_CORE, False)}
_MEMBER: dict[str, Any] = {"user": (_USER, True), "status": (str, True)}
_UPDATE: dict[str, Any] = {
    "update_id": (int, True),
    "message": (_MESSAGE, False),
    "edited_message": (_MESSAGE, False),
    "callback_query": ({"id": (str, True), "from": (_USER, True), "data": (str, False),
                        "message": (_MESSAGE, False)}, False),
    "my_chat_member": ({"chat": (_CHAT, True), "from": (_USER, True), "date": (int, True),
                        "old_chat_member": (_MEMBER, True), "new_chat_member": (_MEMBER, True)}, False),
}
_TYPE_NAMES = {int: "an integer", str: "a string", bool: "true or false"}


def _problem(value: Any, expected: Any, where: str) -> str | None:
    if isinstance(expected, dict):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        for name, (sub, required) in expected.items():
            if name not in value or value[name] is None:
                if required:
                    return f"{where}.{name} is missing"
                continue
            found = _problem(value[name], sub, f"{where}.{name}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(value, list):
            return f"{where} is not a list"
        for i, item in enumerate(value):
            found = _problem(item, expected[0], f"{where}[{i}]")
            if found:
                return found
        return None
    if expected is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{where} is not an integer"
        return None if -INT_BOUND < value < INT_BOUND else f"{where} is out of range"
    if not isinstance(value, expected):
        return f"{where} is not {_TYPE_NAMES.get(expected, expected.__name__)}"
    return None


def _utf16_starts(text: str) -> set[int]:
    """The UTF-16 offsets at which a character of ``text`` starts, and its end."""
    starts, at = set(), 0
    for ch in text:
        starts.add(at)
        at += 2 if ord(ch) > 0xFFFF else 1
    starts.add(at)
    return starts


def _entities_problem(message: dict[str, Any], where: str) -> str | None:
    """Entities must lie within their text, on character boundaries: python-telegram-bot cuts the
    text at the offsets in UTF-16 and decodes the piece, which fails inside a surrogate pair."""
    for text_key, entities_key in (("text", "entities"), ("caption", "caption_entities")):
        entities = message.get(entities_key) or []
        if not entities:
            continue
        starts = _utf16_starts(message.get(text_key) or "")
        for i, entity in enumerate(entities):
            offset, length = entity["offset"], entity["length"]
            if offset < 0 or length < 0 or offset not in starts or offset + length not in starts:
                return f"{where}.{entities_key}[{i}] does not lie on the characters of its {text_key}"
    return None


def update_problem(data: Any) -> str | None:
    """What is wrong with the parsed webhook body ``data`` (a short phrase), or None when
    the fields the adapter reads have the Bot API's types.

    Checked: ``update_id``; for ``message`` / ``edited_message`` (and a message's
    ``reply_to_message``): ``message_id``, ``date``, ``chat`` (``id``, ``type``),
    ``from``, ``text``, ``caption``, the entities (``type``, ``offset``,
    ``length``), ``message_thread_id``, ``is_topic_message``, ``edit_date``; for
    ``callback_query``: ``id``, ``from``, ``data``, ``message``; for
    ``my_chat_member``: ``chat``, ``from``, ``date`` and both members' ``user`` and
    ``status``. Integers must lie within ±:data:`INT_BOUND`; entities must lie on the
    characters of their text (UTF-16 offsets, never inside a surrogate pair). No string anywhere in
    the update may hold a lone surrogate (JSON allows ``"\\ud800"``; UTF-8 cannot
    encode it, so neither Telegram nor the store could take the text back).
    """
    found = _problem(data, _UPDATE, "update")
    if found:
        return found
    messages = [(data.get(k), k) for k in ("message", "edited_message")]
    messages.append(((data.get("callback_query") or {}).get("message"), "callback_query.message"))
    messages += [((m or {}).get("reply_to_message"), f"{k}.reply_to_message") for m, k in list(messages)]
    for message, where in messages:
        found = _entities_problem(message, where) if message else None
        if found:
            return found
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "a string holds a lone surrogate (not encodable as UTF-8)"
    except (ValueError, RecursionError):
        return "the update is nested too deeply"
    return None
