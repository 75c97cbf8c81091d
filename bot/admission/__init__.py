"""Admission control: who gets how much of this process (issue 21, "fair share and cost-aware admission").

One process answers on a few cores; a request's cost is mostly the encoder's work, which
grows with the question's length. Cheap checks come first and nothing here touches the
store. The parts, cheapest first:

* :mod:`bot.admission.connections`: connection caps (in all, per address) and the header
  timeout, before aiohttp parses anything (:class:`ConnectionGate`, :class:`GatedTCPSite`);
* :mod:`bot.admission.middleware`: the body timeout and size check, and holding the 4xx
  answers of failing addresses (:func:`make_middleware`, :func:`install`);
* :mod:`bot.admission.policy`: per-address budgets on the HTTP API, per-user work budgets,
  the window on long questions, and the shutdown deadline (:class:`Admission`);
* :mod:`bot.admission.windowing`: a question's estimated cost and its window
  (:func:`estimate_tokens`, :func:`window_text`);
* :mod:`bot.admission.budgets`: the in-memory token buckets behind the budgets.

The numbers are the ``[admission]`` section of the configuration
(:class:`~bot.config.AdmissionConfig`, ``HEALTHBOT_ADMISSION_<KEY>``), which bot/app.py
passes in. Everything is in memory, per process: each replica protects its own cores.
"""

from bot.admission.budgets import Buckets
from bot.admission.connections import ConnectionGate, GatedTCPSite, raise_fd_limit
from bot.admission.middleware import install, make_middleware
from bot.admission.policy import ADMISSION_KEY, WORK_NOTE, Admission, Admitted
from bot.admission.windowing import LONG_NOTE, estimate_tokens, window_text
from bot.config import AdmissionConfig

__all__ = [
    "ADMISSION_KEY", "Admission", "AdmissionConfig", "Admitted", "Buckets", "ConnectionGate", "GatedTCPSite",
    "LONG_NOTE", "WORK_NOTE", "estimate_tokens", "install", "make_middleware", "raise_fd_limit", "window_text",
]
