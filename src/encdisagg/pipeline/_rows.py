"""What the pipeline keeps in a metadata row besides the decode side's own words.

Prefill writes these words when it packs a request's KV; decode reads them when it commits
the request, before the transfer queue zeroes the row.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ROPE_DELTA_WORD", "SEQ_LEN_WORD"]

#: Words of a metadata row past the four the decode side defines: the pipeline writes the
#: multimodal RoPE offset and the prompt length there.
ROPE_DELTA_WORD: Final = 4
SEQ_LEN_WORD: Final = 5
