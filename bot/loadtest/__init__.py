"""``healthbot loadtest`` and the abuse tests: signed webhook traffic against a running server on
loopback, and its reports.

* :mod:`bot.loadtest.traffic`: the closed-loop load generator (:func:`run_loadtest`), its
  bounds (loopback only, :data:`~bot.loadtest.traffic.MAX_USERS`, ...) and its samples;
* :mod:`bot.loadtest.abuse`: good users beside junk senders or long questions
  (:func:`run_abuse`; ``python -m bot.loadtest --abuse junk|long|both``);
* :mod:`bot.loadtest.messages`: the WeChat and Telegram deliveries it sends (signed, and in
  WeChat's safe mode encrypted) and the reading of WeChat's answers;
* :mod:`bot.loadtest.report`: the text, Markdown and PNG reports.
"""

from bot.loadtest.abuse import AbuseConfig, AbuseResult, format_abuse, run_abuse
from bot.loadtest.report import format_markdown, format_report, write_plot
from bot.loadtest.traffic import LoadtestConfig, LoadtestResult, Sample, check_loopback, run_loadtest

__all__ = ["AbuseConfig", "AbuseResult", "LoadtestConfig", "LoadtestResult", "Sample", "check_loopback",
           "format_abuse", "format_markdown", "format_report", "run_abuse", "run_loadtest", "write_plot"]
