"""Third-party log noise, quiet unless asked for.

- Mooncake's glog lines: see :mod:`encdisagg.transfer._native_logs` (``MC_LOG_LEVEL``
  defaults to ``WARNING`` below ``--log-level debug``; its start-up lines become debug
  records).
- Pillow logs every chunk of every PNG it reads at debug level: kept at ``INFO`` even under
  ``--log-level debug``, unless ``ENCDISAGG_THIRD_PARTY_DEBUG=1``.
"""

from __future__ import annotations

import logging
import os
from typing import Final

from ..transfer._native_logs import quiet_mooncake_by_default

__all__ = ["NOISY_LOGGERS", "THIRD_PARTY_DEBUG_ENV", "quiet_third_party"]

#: Loggers whose debug records are noise to an operator.
NOISY_LOGGERS: Final = ("PIL",)
#: Set to ``1`` to see the debug records of :data:`NOISY_LOGGERS` too.
THIRD_PARTY_DEBUG_ENV: Final = "ENCDISAGG_THIRD_PARTY_DEBUG"


def quiet_third_party(level: str) -> None:
    """Quiet the libraries' noise for a process logging at ``level``; call it before the
    Mooncake engine starts (data-parallel workers inherit the environment). Not async."""
    asked = os.environ.get(THIRD_PARTY_DEBUG_ENV) == "1"
    quiet_mooncake_by_default(debug=asked or level.lower() == "debug")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if asked else logging.INFO)
