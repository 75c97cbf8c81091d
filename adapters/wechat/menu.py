"""The account's custom menu as a file (自定义菜单 / 创建接口): read (JSON or TOML) and checked
against WeChat's documented limits before :meth:`adapters.wechat.api.WechatApi.create_menu`
sends it (``healthbot wechat menu``). Also importable from :mod:`adapters.wechat.api`."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from adapters.wechat import constants as wc

__all__ = ["load_menu", "validate_menu"]

_BUTTON_KEYS = {"click": "key", "view": "url", "scancode_push": "key", "scancode_waitmsg": "key",
                "pic_sysphoto": "key", "pic_photo_or_album": "key", "pic_weixin": "key", "location_select": "key",
                "media_id": "media_id", "article_id": "article_id", "article_view_limited": "article_id",
                "miniprogram": "url"}


def validate_menu(menu: Any) -> None:
    """Check ``menu`` against the documented limits of 自定义菜单 / 创建接口.

    At most :data:`~adapters.wechat.constants.MENU_MAX_BUTTONS` top-level buttons
    with names of at most 16 bytes, each either with a ``type`` (and its ``key``,
    ``url``, … field) or with 1–5 ``sub_button`` of names at most 60 bytes.

    Raises:
        ValueError: naming the offending button.
    """
    if not isinstance(menu, dict) or not isinstance(menu.get("button"), list) or not menu["button"]:
        raise ValueError('menu must be an object with a non-empty "button" list')
    buttons = menu["button"]
    if len(buttons) > wc.MENU_MAX_BUTTONS:
        raise ValueError(f"menu has {len(buttons)} top-level buttons; WeChat allows {wc.MENU_MAX_BUTTONS}")

    def check(button: Any, where: str, max_name: int) -> None:
        if not isinstance(button, dict) or not isinstance(button.get("name"), str) or not button["name"]:
            raise ValueError(f"{where}: needs a non-empty string 'name'")
        if len(button["name"].encode("utf-8")) > max_name:
            raise ValueError(f"{where} {button['name']!r}: name over {max_name} bytes")
        kind = button.get("type")
        if kind not in _BUTTON_KEYS:
            raise ValueError(f"{where} {button['name']!r}: type {kind!r} is not one of {sorted(_BUTTON_KEYS)}")
        if not button.get(_BUTTON_KEYS[kind]):
            raise ValueError(f"{where} {button['name']!r}: type {kind!r} needs {_BUTTON_KEYS[kind]!r}")

    for i, button in enumerate(buttons, 1):
        where = f"button {i}"
        subs = button.get("sub_button") if isinstance(button, dict) else None
        if subs:
            if not isinstance(button.get("name"), str) or not button["name"]:
                raise ValueError(f"{where}: needs a non-empty string 'name'")
            if len(button["name"].encode("utf-8")) > wc.MENU_NAME_MAX_BYTES:
                raise ValueError(f"{where} {button['name']!r}: name over {wc.MENU_NAME_MAX_BYTES} bytes")
            if not isinstance(subs, list) or len(subs) > wc.MENU_MAX_SUB_BUTTONS:
                raise ValueError(f"{where} {button['name']!r}: 1-{wc.MENU_MAX_SUB_BUTTONS} sub_button allowed")
            for j, sub in enumerate(subs, 1):
                check(sub, f"{where}.{j}", wc.MENU_SUB_NAME_MAX_BYTES)
        else:
            check(button, where, wc.MENU_NAME_MAX_BYTES)


def load_menu(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a menu file: JSON (WeChat's own ``{"button": [...]}``) or TOML
    (``[[button]]`` tables, ``[[button.sub_button]]`` under them), by extension
    (``.toml``; anything else is read as JSON).

    Raises:
        ValueError: unreadable, not JSON/TOML, or breaking a limit (:func:`validate_menu`).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        menu = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"menu file {p}: {exc}") from None
    validate_menu(menu)
    return menu
