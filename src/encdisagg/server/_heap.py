"""Keeping the cyclic collector's full passes short: freeze what startup left alive.

A process that imported torch and transformers and opened an Encoder holds a few hundred
thousand objects that live as long as it does (about 370,000 with the embedded model). Every
full pass of the cyclic garbage collector visits all of them, about 0.15 s on the
development machine, and a busy server triggers one every few thousand requests: the
objects of requests in flight outlive the young generations and count towards the next full
pass. Frozen once after startup (``gc.freeze``), those objects are out of the collector's
reach, and a full pass visits only what was allocated since. Reference counting still frees
everything as before; only cyclic garbage among the frozen objects is never collected, and
there is none of that to speak of right after a collection.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze_startup_heap"]

_log = logging.getLogger("encdisagg.server")


def freeze_startup_heap() -> int:
    """Collect what is garbage now, then freeze every object that survived; how many are
    frozen in all. Not async: it costs one full collection (about 0.15 s here), so call it
    once, after startup, before serving."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    _log.debug("froze %d objects left alive by startup", frozen)
    return frozen
