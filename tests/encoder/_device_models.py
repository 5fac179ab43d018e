"""A scripted model whose embeddings live on the tests' device (``ENCDISAGG_TEST_DEVICE``),
so the Encoder stages them there: its arena, its device-to-host copies, its registrations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from encdisagg.models import Preprocessed

from .._device import chosen_device
from .fakes import ScriptedModel


class DeviceScriptedModel(ScriptedModel):
    """:class:`ScriptedModel` with its rows moved onto :attr:`device` (the CPU by default:
    then it behaves exactly as its base)."""

    def __init__(self, *, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size=hidden_size, dtype=dtype)
        self.device = chosen_device()

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        return [rows.to(self.device) for rows in super().forward(batch)]
