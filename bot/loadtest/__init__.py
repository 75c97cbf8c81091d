"""``healthbot loadtest`` and the abuse tests: signed webhook traffic against a running server on
loopback, and its reports.

* :mod:`bot.loadtest.traffic`: the closed-loop load generator (:func:`run_loadtest`), its
  bounds (loopback only, :data:`~bot.loadtest.traffic.MAX_USERS`, ...) and its samples;
* :mod:`bot.loadtest.openloop`: the open-loop load generator (``--rate``: a fixed arrival
  rate, latency from the scheduled send; :func:`run_open_loop`) and ``--ramp``
  (:func:`run_ramp`: the highest rate with p99 under a bound);
* :mod:`bot.loadtest.cpu`: the server's CPU per message (psutil, or its ``/metrics``) and a
  server started for the run (``--start-server``);
* :mod:`bot.loadtest.abuse`: good users beside junk senders or long questions
  (:func:`run_abuse`; ``python -m bot.loadtest --abuse junk|long|both``);
* :mod:`bot.loadtest.messages`: the WeChat and Telegram deliveries it sends (signed, and in
  WeChat's safe mode encrypted) and the reading of WeChat's answers;
* :mod:`bot.loadtest.report`, :mod:`bot.loadtest.open_report`: the text, Markdown, PNG and
  CSV reports; :mod:`bot.loadtest.cli`: what the ``healthbot loadtest`` subcommand runs.
"""

from bot.loadtest.abuse import AbuseConfig, AbuseResult, format_abuse, run_abuse
from bot.loadtest.open_report import format_open, format_open_markdown, format_ramp, write_ramp_plot
from bot.loadtest.openloop import OpenLoopConfig, OpenLoopResult, RampResult, run_open_loop, run_ramp
from bot.loadtest.report import format_markdown, format_report, write_plot
from bot.loadtest.traffic import LoadtestConfig, LoadtestResult, Sample, check_loopback, run_loadtest

__all__ = ["AbuseConfig", "AbuseResult", "LoadtestConfig", "LoadtestResult", "OpenLoopConfig", "OpenLoopResult",
           "RampResult", "Sample", "check_loopback", "format_abuse", "format_markdown", "format_open",
           "format_open_markdown", "format_ramp", "format_report", "run_abuse", "run_loadtest", "run_open_loop",
           "run_ramp", "write_plot", "write_ramp_plot"]
