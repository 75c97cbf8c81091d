"""Query term normalization: everyday, dialect, misspelt and TCM wordings → the knowledge base's words.

Applied to a question after safety.normalize (Simplified Chinese, lowercase) and
before retrieval, so that equivalent wordings retrieve the same topic:

* TCM synonyms (上火 / 虚火 / 火气大; 湿气重 / 湿气大 / 湿重);
* common homophone typos of symptom words typed with pinyin input (胃涨 → 胃胀);
* colloquial and northern words (冒痘 → 长痘, 拉稀 → 腹泻, 打呼噜 → 打鼾);
* Cantonese function words and verbs, which Simplified-Chinese text models and
  jieba handle poorly (唔 → 不, 冇 → 没有, 瞓 → 睡, 攰 → 累).

The table is data, longest key first; add wordings as they turn up in logs.
"""

from __future__ import annotations

import re

#: wording -> knowledge-base wording
TERMS: dict[str, str] = {
    # TCM synonyms
    "虚火旺": "上火", "虚火": "上火", "火气大": "上火", "上火了": "上火", "肝火旺": "上火",
    "湿气大": "湿气重", "湿气很重": "湿气重", "湿重": "湿气重", "体内湿气": "湿气重", "湿邪": "湿气重",
    # homophone typos (pinyin input)
    "胃涨": "胃胀", "肚子涨": "肚子胀", "腹涨": "腹胀", "涨气": "胀气", "涨得": "胀得",
    "失民": "失眠", "睡不找": "睡不着", "便泌": "便秘", "口腔溃病": "口腔溃疡", "张溃疡": "长溃疡",
    "头运": "头晕", "咳漱": "咳嗽",
    # colloquial wordings
    "冒痘": "长痘", "爆痘": "长痘", "起痘": "长痘", "痘痘": "痘",
    "拉稀": "腹泻", "跑肚": "腹泻", "闹肚子": "腹泻", "窜稀": "腹泻",
    "打呼噜": "打鼾", "打呼": "打鼾",
    "掉头发": "脱发", "发际线后移": "脱发", "发际线往后退": "脱发",
    "吃撑": "吃多了积食", "消消食": "助消化",
    "大号": "大便", "解大手": "大便",
    # Cantonese
    "唔": "不", "冇": "没有", "咗": "了", "嘅": "的", "佢": "他", "瞓": "睡", "攰": "累",
    "咩": "什么", "乜嘢": "什么", "点样": "怎样", "系咪": "是不是", "啲": "些",
    "嘢": "东西", "成日": "经常", "颈膊": "颈肩", "膊头": "肩膀", "对住": "对着",
}

_PATTERN = re.compile("|".join(re.escape(k) for k in sorted(TERMS, key=len, reverse=True)))


def canonical_terms(text: str) -> str:
    """``text`` with every known wording replaced by the knowledge base's word."""
    return _PATTERN.sub(lambda m: TERMS[m.group(0)], text)
