"""WeChat official-account (公众号) adapter: ``GET /wechat`` and ``POST /wechat``.

A thin translator (ARCHITECTURE.md, "One message, end to end"): it checks the
request really comes from WeChat, parses the XML into one :class:`bot.types.Inbound`,
calls ``dispatcher.handle`` and renders the :class:`bot.types.Reply` as a passive
reply (or, when late, through the customer-service API or on the user's next
message). No business logic: which text a follow, a voice note or a menu click
gets is the dispatcher's decision.

Protocol source: WeChat official-account developer documentation
(https://developers.weixin.qq.com/doc/offiaccount/), pages 接入指南 (URL
verification), 接收普通消息, 接收事件推送, 被动回复用户消息, 消息加解密说明, 客服消息
and 消息转发到客服; limits in :mod:`adapters.wechat.constants`. Signatures, AES and
message parsing use wechatpy; untrusted XML passes defusedxml (no DTD, no
entities) before any parser. Outbound API calls: :mod:`adapters.wechat.api`.

Request checks, in order (each answers a short plain-text body, never a trace):

* signature — ``signature`` = sha1 of the sorted [token, timestamp, nonce]; bad or
  missing: 403 ``invalid signature``. Encrypted requests also need ``msg_signature``
  = sha1 of the sorted [token, timestamp, nonce, Encrypt] (403 when wrong).
* timestamp — not 1–15 digits, or further than ``wechat.timestamp_window_s`` from
  now: 403 (replay).
* body — over ``server.max_body_bytes``: 413; not UTF-8, not well-formed, with a
  DOCTYPE or entities, nested deeper than
  :data:`~adapters.wechat.parsing.MAX_XML_DEPTH`, or not a WeChat message (a text
  field holding elements, a repeated field): 400. Parsing lives in
  :mod:`adapters.wechat.parsing`; in the encrypted modes ``<Encrypt>`` is found
  without an XML parser and ``msg_signature`` checked before the envelope is parsed.
* replay (plaintext mode) — a (timestamp, nonce) seen before with another body: 403
  ``replayed nonce``. A text message for the dispatcher carries the record to its
  dedup claim (one store round trip, bot/dedup.py); a "1", a feedback click or an
  event is checked on its own first (:mod:`adapters.wechat.webhook`).

Modes (``wechat.mode``): ``plaintext``; ``safe`` — every POST is AES-encrypted
(``encrypt_type=aes``), decrypted with ``msg_signature`` and answered encrypted;
``compatible`` — encrypted when the query says ``encrypt_type=aes``, else plaintext.

The deadline:
    WeChat waits :data:`~adapters.wechat.constants.REPLY_DEADLINE_S` (5 s) and then
    re-delivers, :data:`~adapters.wechat.constants.MAX_DELIVERIES` (3) times in all;
    after the last failed one the user sees "该公众号暂时无法提供服务". Answering
    ``success`` stops the retries. Each delivery waits for ``dispatcher.handle`` (which
    computes a message once, however often it is delivered) at most
    ``wechat.reply_budget_s`` from the request's arrival, on a *shielded* task:

    * ready in time: the passive reply;
    * not ready: ``success`` at once; when the computation ends, the answer goes out
      (``account_type = "service"``) through ``/cgi-bin/message/custom/send``, or
      (``"subscription"``, no such API) into the user's pending-answer queue, from
      which the next passive reply to that user — WeChat's next delivery of the same
      message, or the user's next message — takes it (prefixed with the question it
      answers). A failed customer-service send also falls back to that queue.

    Exactly one path delivers each answer. The store key ``wechat:delivered:<MsgId>``
    (:data:`DELIVERED_KEY`) is claimed with ``set_if_absent`` by whoever delivers:
    a passive reply (the value keeps the reply, so a re-delivery WeChat makes because
    our response did not reach it gets the same reply again), the customer-service
    sender, or the pending queue. The dispatcher's dedup hands a retry the same
    finished Reply; the claim is what stops it from also being queued or sent. Queue
    entries leave only through ``pop_all`` immediately followed by a passive reply.

    Shutdown (:meth:`WechatAdapter.drain`, then :meth:`WechatAdapter.hand_over`): late
    answers still computing at the server's drain deadline are handed to the store
    (``wechat:unfinished``) and the next process to start computes and delivers them;
    pages not yet sent go to the pending queue. Nothing is delivered after the store
    is closed.

    Not chosen: holding deliveries 1 and 2 open past 5 s so that WeChat's retry picks
    up a late answer. A miscounted delivery (one lost on the way) would make us hold
    the last one, and the user would see WeChat's error.

Long answers (:func:`paginate`): split on sentence boundaries into pages of at most
:data:`~adapters.wechat.constants.PASSIVE_TEXT_MAX_BYTES` UTF-8 bytes, the closing
paragraph (the medical disclaimer) repeated on every page. A passive reply carries
page 1; the rest go out through the customer-service API (service accounts, at most
:data:`~adapters.wechat.constants.KF_MESSAGES_PER_USER_MESSAGE` messages) or wait in
``wechat:more:<OpenID>`` with a "回复 1 查看更多" / "Reply 1 for more" line: a
user's "1" gets the next page.

Handoff: a Reply with intent HANDOFF (the user asked for a person, or the
dispatcher relays a message of a user already handed off) is answered with MsgType
``transfer_customer_service`` (with ``<TransInfo><KfAccount>`` when
``wechat.kf_account`` is set); the dispatcher records the handoff itself. A service
account also sends the Reply's text through the customer-service API.

Message kinds: text → TEXT; voice → TEXT with ``Recognition`` when WeChat's speech
recognition filled it, else UNSUPPORTED (``raw["type"] = "voice"``); image, video,
shortvideo, location, link, file and any other type → UNSUPPORTED (``raw["type"]``);
event subscribe (also by QR code) → SUBSCRIBE; every other event → EVENT with
``raw["event"]`` (lower case) and ``raw["event_key"]``. Menu CLICK is an EVENT, not
TEXT: its EventKey is an identifier the operator chose in the menu editor
(``V1001_TIPS``), not words a user typed. An EVENT reply with empty text answers
``success`` (or what is pending for the user). ``unsubscribe`` answers ``success``
and forgets the user: the dispatcher's handoff and session state, the pending
queue and unread pages.

Where each part lives (this package; import from the modules, the names below are
re-exported for callers):

* :mod:`~adapters.wechat.webhook` — :class:`WechatAdapter`'s HTTP side: signature,
  timestamp, decryption, parsing, rendering; :func:`setup_wechat`.
* :mod:`~adapters.wechat.passive` — what one delivery answers: the exactly-once
  claim, paging and "1", the pending queue, unsubscribe.
* :mod:`~adapters.wechat.late` — answers ready after their webhook answered: the
  customer-service API or the pending queue; shutdown hand-over and recovery.
* :mod:`~adapters.wechat.store_state` — the store keys, their lifetimes and values.
* :mod:`~adapters.wechat.feedback` — the 👍 / 👎 menu message after answers sent through the
  customer-service API (``wechat.feedback_menu``, service accounts), and its clicks as votes.
* :mod:`~adapters.wechat.pages` — long answers as pages; :mod:`~adapters.wechat.replies`
  — the passive reply XML; :mod:`~adapters.wechat.parsing` — the request XML;
  :mod:`~adapters.wechat.api` — the server API (token, customer service, menu);
  :mod:`~adapters.wechat.constants` — the protocol's limits with their sources.

Shared with the Telegram adapter: :mod:`adapters.text_split` (the one splitter of
long texts) and :mod:`adapters.masking` (ids in logs).
"""

from adapters.wechat.pages import Pages, paginate, split_text
from adapters.wechat.parsing import parse_inbound, strip_invalid_xml_chars
from adapters.wechat.replies import fit_passive_text, render_text_reply, render_transfer_reply
from adapters.wechat.store_state import DELIVERED_KEY, MORE_KEY, PENDING_KEY, SEGMENT_SEPARATOR, UNFINISHED_KEY
from adapters.wechat.webhook import WECHAT_ADAPTER, WechatAdapter, setup_wechat

__all__ = [
    "DELIVERED_KEY",
    "MORE_KEY",
    "PENDING_KEY",
    "SEGMENT_SEPARATOR",
    "UNFINISHED_KEY",
    "WECHAT_ADAPTER",
    "Pages",
    "WechatAdapter",
    "fit_passive_text",
    "paginate",
    "parse_inbound",
    "render_text_reply",
    "render_transfer_reply",
    "setup_wechat",
    "split_text",
    "strip_invalid_xml_chars",
]
