"""The safety section of the configuration (``[safety]`` in the TOML file); bot/config.py
composes it with the others."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SafetyConfig:
    """Emergency numbers by language (topics.yaml "Intents": 120 mainland China;
    112/911 abroad) and the crisis line (12356, China's national mental-health line)."""

    emergency_number_zh: str = "120"
    emergency_number_en: str = "112 / 911"
    crisis_line_zh: str = "12356"
    crisis_line_en: str = "988 (US) / your local crisis line"

    def contacts(self, lang: str) -> tuple[str, str]:
        """(the emergency number, the crisis line) in ``lang`` ("zh", else English)."""
        if lang == "zh":
            return self.emergency_number_zh, self.crisis_line_zh
        return self.emergency_number_en, self.crisis_line_en
