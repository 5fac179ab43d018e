"""A plain allow-listing unpickler for the tests: reads our SGLang header frames back.

It admits exactly the globals SGLang's receiver needs from us and returns stand-ins for
them, so the tests check the fields without sglang installed. Anything else is refused.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any


class StandInEmbeddingData:
    """Stands in for ``sglang...receiver.EmbeddingData``: a plain attribute bag."""


@dataclass(frozen=True)
class StandInModality:
    value: int


@dataclass(frozen=True)
class StandInDtype:
    name: str


@dataclass(frozen=True)
class StandInTensor:
    rows: list[Any]


_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class AllowListingUnpickler(pickle.Unpickler):
    """Admits EmbeddingData, Modality, the ``torch`` dtypes and ``torch.tensor``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"):
            return StandInEmbeddingData
        if (module, name) == ("sglang.srt.managers.schedule_batch", "Modality"):
            return StandInModality
        if module == "torch" and name in _DTYPES:
            return StandInDtype(name)
        if (module, name) == ("torch", "tensor"):
            return StandInTensor
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_header(frame: bytes) -> dict[str, Any]:
    """The header frame's object's attributes (its ``__dict__``)."""
    value = AllowListingUnpickler(io.BytesIO(frame)).load()
    assert type(value) is StandInEmbeddingData
    return dict(vars(value))
