"""The texts the Telegram adapter owns (help, confirmations, notices) and its command menu."""

from __future__ import annotations

import re

__all__ = ["COMMANDS", "LANG_BUTTON_PREFIX", "LANG_BUTTON_RE", "OFFER_BUTTONS", "TEXTS", "lang_arg"]

TEXTS: dict[str, dict[str, str]] = {
    "help": {
        "zh": "我是健康养生小助手，可以回答日常养生问题，例如“手脚冰凉怎么办”“失眠怎么调理”。"
              "内容仅供健康科普参考，不能代替医生的诊断和治疗。\n\n"
              "/start 开始\n/help 帮助\n/human 转人工客服\n/stop 结束人工对话并清除会话记录\n"
              "/lang 选择语言（中文 / English）\n\n"
              "群聊中请 @我 或回复我的消息提问。紧急情况请立即拨打 {emergency}。",
        "en": "I answer everyday health and wellness questions, e.g. \"my hands and feet are always cold\" "
              "or \"how can I sleep better\". This is general health information, not a diagnosis or "
              "treatment by a doctor.\n\n"
              "/start start\n/help this help\n/human talk to a person\n"
              "/stop end a conversation with a person and forget this session\n"
              "/lang choose the language (中文 / English)\n\n"
              "In groups, mention me or reply to my message. In an emergency call {emergency} now.",
    },
    "lang_prompt": {"zh": "请选择语言：", "en": "Choose a language:"},
    "lang_set": {"zh": "好的，之后用中文回答您。", "en": "OK, I will answer in English from now on."},
    "human_started": {"zh": "已为您转接人工客服，请直接发送您的问题，客服会在这里回复您。发送 /stop 可结束。",
                      "en": "You are being connected to a person. Send your question here and an agent "
                            "will reply in this chat. Send /stop to end."},
    "human_already": {"zh": "您已在人工客服对话中，请直接发送消息。发送 /stop 可结束。",
                      "en": "You are already talking to a person; just send your message. Send /stop to end."},
    "human_unavailable": {"zh": "抱歉，现在没有人工客服可以接待您。健康方面的问题可以继续问我；情况紧急请直接拨打{emergency}。",
                          "en": "Sorry, no member of our team can chat right now. You can keep asking me health "
                                "questions; in an emergency call your local emergency number now."},
    "human_private_only": {"zh": "为保护您的隐私，请私聊我并发送 /human 转人工客服。",
                           "en": "To protect your privacy, message me privately and send /human there."},
    "stopped_handoff": {"zh": "已结束人工客服对话，并清除了本次会话记录。随时可以继续向我提问。",
                        "en": "The conversation with the agent has ended and this session is forgotten. "
                              "Ask me anything any time."},
    "stopped": {"zh": "已清除您的会话记录。随时可以继续向我提问。",
                "en": "Your session is forgotten. Ask me anything any time."},
    "unknown_command": {"zh": "没有这个命令。发送 /help 查看可用命令，或直接输入您的问题。",
                        "en": "Unknown command. Send /help for the commands, or just type your question."},
    "unknown_button": {"zh": "这个按钮已失效。发送 /lang 可重新选择语言。",
                       "en": "This button no longer works. Send /lang to choose the language again."},
}

COMMANDS: dict[str, list[tuple[str, str]]] = {
    "zh": [("start", "开始"), ("help", "帮助"), ("human", "转人工客服"), ("stop", "结束人工对话并清除会话"),
           ("lang", "选择语言")],
    "en": [("start", "Start"), ("help", "Help"), ("human", "Talk to a person"),
           ("stop", "End the conversation with a person, forget the session"), ("lang", "Choose the language")],
}
"""The command menu registered with setMyCommands at start-up (zh default, en for English clients)."""

OFFER_BUTTONS: dict[str, list[str]] = {"zh": ["是", "不是"], "en": ["Yes", "No"]}
"""The yes and the no under a "did you mean …?" offer (bot/suggestion.py), by ``Reply.lang``; a list of
topics gets its numbers ("1", "2", "3") before the no. A tap sends the label as a message, which the
dispatcher reads as the answer to the offer (bot/suggestion_rules.yaml; Latin text arrives lowercased).
"是" / "不是" are written the same in Traditional script."""

LANG_BUTTON_PREFIX = "lang:"
LANG_BUTTON_RE = re.compile(rf"{LANG_BUTTON_PREFIX}(zh|en)")
"""The whole callback data of a /lang button (matched with ``fullmatch``: ``"lang:zh\\n"`` is not one)."""


def lang_arg(value: str) -> str | None:
    v = value.strip().lower()
    if v.startswith("zh") or v in ("中文", "中", "汉语", "chinese", "cn"):
        return "zh"
    if v.startswith("en") or v in ("english", "英文", "英语"):
        return "en"
    return None
