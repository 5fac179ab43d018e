"""Third-party log noise, quiet unless asked for.

- Mooncake's glog lines: see :mod:`encdisagg.transfer._mooncake._native_logs` (``MC_LOG_LEVEL``
  defaults to ``WARNING`` below ``--log-level debug``; its start-up lines become debug
  records).
- Pillow logs every chunk of every PNG it reads at debug level: kept at ``INFO`` even under
  ``--log-level debug``, unless ``ENCDISAGG_THIRD_PARTY_DEBUG=1``.
- transformers draws a progress bar while it loads a checkpoint's weights (carriage returns
  in a log stream, and in the middle of JSON lines): off below ``--log-level debug``, for
  the data-parallel workers too (``HF_HUB_DISABLE_PROGRESS_BARS``, which they inherit).
"""

from __future__ import annotations

import logging
import os
from typing import Final

from ...transfer._mooncake._native_logs import quiet_mooncake_by_default

__all__ = ["NOISY_LOGGERS", "THIRD_PARTY_DEBUG_ENV", "quiet_third_party"]

#: Loggers whose debug records are noise to an operator.
NOISY_LOGGERS: Final = ("PIL",)
#: Set to ``1`` to see the debug records of :data:`NOISY_LOGGERS` too.
THIRD_PARTY_DEBUG_ENV: Final = "ENCDISAGG_THIRD_PARTY_DEBUG"
_PROGRESS_BARS_ENV: Final = "HF_HUB_DISABLE_PROGRESS_BARS"


def quiet_third_party(level: str) -> None:
    """Quiet the libraries' noise for a process logging at ``level``; call it before the
    Mooncake engine starts (data-parallel workers inherit the environment). Not async."""
    asked = os.environ.get(THIRD_PARTY_DEBUG_ENV) == "1"
    debug = asked or level.lower() == "debug"
    quiet_mooncake_by_default(debug=debug)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if asked else logging.INFO)
    if not debug:
        os.environ.setdefault(_PROGRESS_BARS_ENV, "1")
        if os.environ[_PROGRESS_BARS_ENV] == "1":
            # Read once when transformers is imported, which may have happened already.
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
