"""An independent WeChat-server stand-in for tests: signs, encrypts and builds requests.

Written from WeChat's documentation, not from the adapter or wechatpy, so a bug
shared by both cannot hide (official-account docs: 接入指南, 接收普通消息,
接收事件推送, 消息加解密说明):

* signature = sha1(concatenation of sorted [token, timestamp, nonce]), hex;
* msg_signature = sha1(concatenation of sorted [token, timestamp, nonce, Encrypt]);
* Encrypt = base64(AES-256-CBC(key, IV = key[:16],
  PKCS#7-to-32-bytes(random 16 bytes + len(msg) as 4-byte big-endian + msg + appid))),
  key = base64decode(EncodingAESKey + "=").
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import struct
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK = 32  # WeChat's PKCS#7 block size (not AES's 16)


def sign(token: str, timestamp: str, nonce: str, *extra: str) -> str:
    """sha1 hex of the sorted, concatenated parts (WeChat's signature scheme)."""
    return hashlib.sha1("".join(sorted([token, timestamp, nonce, *extra])).encode()).hexdigest()


def new_aes_key() -> str:
    """A random 43-character EncodingAESKey."""
    return base64.b64encode(os.urandom(32)).decode().rstrip("=")


def _key(aes_key: str) -> bytes:
    key = base64.b64decode(aes_key + "=")
    assert len(key) == 32
    return key


def encrypt(aes_key: str, appid: str, message: str, random16: bytes | None = None) -> str:
    """The base64 ``Encrypt`` value for ``message`` (消息加解密说明)."""
    key = _key(aes_key)
    msg = message.encode()
    plain = (random16 or os.urandom(16)) + struct.pack(">I", len(msg)) + msg + appid.encode()
    pad = BLOCK - len(plain) % BLOCK
    plain += bytes([pad]) * pad
    enc = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return base64.b64encode(enc.update(plain) + enc.finalize()).decode()


def decrypt(aes_key: str, encrypted: str) -> tuple[str, str]:
    """(message, appid) from a base64 ``Encrypt`` value; checks the padding."""
    key = _key(aes_key)
    dec = Cipher(algorithms.AES(key), modes.CBC(key[:16])).decryptor()
    plain = dec.update(base64.b64decode(encrypted)) + dec.finalize()
    pad = plain[-1]
    assert 1 <= pad <= BLOCK and plain[-pad:] == bytes([pad]) * pad, "bad PKCS#7 padding"
    plain = plain[:-pad]
    (length,) = struct.unpack(">I", plain[16:20])
    return plain[20:20 + length].decode(), plain[20 + length:].decode()


def _cdata(value: str) -> str:
    return "<![CDATA[" + value.replace("]]>", "]]]]><![CDATA[>") + "]]>"


def message_xml(fields: dict[str, Any]) -> str:
    """``<xml>`` with one child per field: strings in CDATA, ints bare (as WeChat sends)."""
    parts = []
    for name, value in fields.items():
        inner = str(value) if isinstance(value, int) else _cdata(str(value))
        parts.append(f"<{name}>{inner}</{name}>")
    return "<xml>" + "".join(parts) + "</xml>"


ACCOUNT = "gh_test_account"
USER = "oUSER_openid_0123456789abcd"


def text_xml(content: str, msg_id: int = 1234567890123456, user: str = USER, create_time: int | None = None) -> str:
    """A text message (接收普通消息 / 文本消息)."""
    return message_xml({"ToUserName": ACCOUNT, "FromUserName": user,
                        "CreateTime": create_time or int(time.time()), "MsgType": "text",
                        "Content": content, "MsgId": msg_id})


def voice_xml(recognition: str | None, msg_id: int = 2234567890123456) -> str:
    """A voice message; ``Recognition`` only when given (语音识别结果)."""
    fields: dict[str, Any] = {"ToUserName": ACCOUNT, "FromUserName": USER, "CreateTime": int(time.time()),
                              "MsgType": "voice", "MediaId": "media_voice_1", "Format": "amr"}
    if recognition is not None:
        fields["Recognition"] = recognition
    fields["MsgId"] = msg_id
    return message_xml(fields)


def media_xml(msg_type: str, msg_id: int = 3234567890123456) -> str:
    """An image / video / shortvideo / location / link / file message (minimal fields)."""
    extra: dict[str, dict[str, Any]] = {
        "image": {"PicUrl": "http://mmbiz.example/pic.jpg", "MediaId": "media_img_1"},
        "video": {"MediaId": "media_vid_1", "ThumbMediaId": "thumb_1"},
        "shortvideo": {"MediaId": "media_vid_2", "ThumbMediaId": "thumb_2"},
        "location": {"Location_X": "23.134521", "Location_Y": "113.358803", "Scale": 20, "Label": "广州"},
        "link": {"Title": "标题", "Description": "描述", "Url": "http://example.com/a"},
        "file": {"Title": "a.pdf", "Description": "", "FileKey": "k", "FileMd5": "m", "FileTotalLen": 10},
    }
    return message_xml({"ToUserName": ACCOUNT, "FromUserName": USER, "CreateTime": int(time.time()),
                        "MsgType": msg_type, **extra[msg_type], "MsgId": msg_id})


def event_xml(event: str, key: str | None = None, create_time: int | None = None) -> str:
    """An event push (接收事件推送)."""
    fields: dict[str, Any] = {"ToUserName": ACCOUNT, "FromUserName": USER,
                              "CreateTime": create_time or int(time.time()), "MsgType": "event", "Event": event}
    if key is not None:
        fields["EventKey"] = key
    return message_xml(fields)


def parse_reply(body: str) -> dict[str, str]:
    """Children of a reply's ``<xml>`` root as {tag: text} (the test trusts the server under test
    not to send entities; the stdlib parser would expand them)."""
    root = ET.fromstring(body)
    assert root.tag == "xml", body
    return {child.tag: child.text or "" for child in root}


@dataclass
class WechatSigner:
    """Builds the query strings and bodies WeChat would send to one account's webhook."""

    token: str
    appid: str = "wx0123456789abcdef"
    aes_key: str = ""

    def query(self, *, timestamp: int | None = None, nonce: str | None = None, **extra: str) -> dict[str, str]:
        """``signature``/``timestamp``/``nonce`` (+ ``extra``) for a plaintext request; a fresh random
        nonce unless one is given, as WeChat sends (the server refuses a nonce reused with another body)."""
        ts = str(int(time.time()) if timestamp is None else timestamp)
        nonce = str(random.randint(10**8, 10**10)) if nonce is None else nonce
        return {"signature": sign(self.token, ts, nonce), "timestamp": ts, "nonce": nonce, **extra}

    def verify_url(self, echostr: str, **kw: Any) -> str:
        """Path + query of a GET URL verification."""
        return "/wechat?" + urlencode(self.query(echostr=echostr, **kw))

    def plain_post(self, xml: str, **kw: Any) -> tuple[str, bytes]:
        """(path + query, body) of a plaintext POST."""
        return "/wechat?" + urlencode(self.query(openid="x", **kw)), xml.encode()

    def safe_post(self, xml: str, *, timestamp: int | None = None, nonce: str = "987654321") -> tuple[str, bytes]:
        """(path + query, body) of a safe-mode POST: encrypted body + ``msg_signature``."""
        ts = str(int(time.time()) if timestamp is None else timestamp)
        enc = encrypt(self.aes_key, self.appid, xml)
        q = {"signature": sign(self.token, ts, nonce), "timestamp": ts, "nonce": nonce, "openid": USER,
             "encrypt_type": "aes", "msg_signature": sign(self.token, ts, nonce, enc)}
        body = f"<xml><ToUserName><![CDATA[{ACCOUNT}]]></ToUserName><Encrypt><![CDATA[{enc}]]></Encrypt></xml>"
        return "/wechat?" + urlencode(q), body.encode()

    def open_safe_reply(self, body: str) -> str:
        """The plaintext reply XML inside a safe-mode reply; checks its MsgSignature and appid."""
        env = parse_reply(body)
        expected = sign(self.token, env["TimeStamp"], env["Nonce"], env["Encrypt"])
        assert env["MsgSignature"] == expected, "reply MsgSignature does not verify"
        xml, appid = decrypt(self.aes_key, env["Encrypt"])
        assert appid == self.appid, appid
        return xml
