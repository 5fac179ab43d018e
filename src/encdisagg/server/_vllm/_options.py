"""The ``vllm_*`` server settings of ``--wire vllm``, checked without importing torch.

:class:`~encdisagg.server.ServerSettings` holds them as flat fields (so each is a flag, an
environment variable and a TOML key like every other setting); this module says which values
are valid, so the command line refuses a bad one before the model loads.
"""

from __future__ import annotations

from typing import Final, Protocol

from ..._errors import ConfigError

__all__ = ["CONNECTORS", "canonical_dtype", "check_vllm_settings"]

#: vLLM's EC connectors this server produces for: shared storage, and the Mooncake push.
CONNECTORS: Final = ("example", "mooncake")


#: Each accepted dtype spelling -> its ``torch`` attribute name (what vLLM's ``reserve`` and
#: safetensors' header name).
_CANONICAL: Final = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def canonical_dtype(name: str) -> str:
    """``name`` (any accepted spelling, ``torch.`` prefix allowed) as a torch attribute
    name: ``"bf16"`` -> ``"bfloat16"``. Not async.

    :raises ConfigError: for a name that is no floating dtype this server writes.
    """
    key = name.strip().lower().removeprefix("torch.")
    if key not in _CANONICAL:
        raise ConfigError(f"vllm_dtype must be one of {', '.join(_CANONICAL)}; got {name!r}")
    return _CANONICAL[key]


class _Settings(Protocol):
    @property
    def wire(self) -> str: ...
    @property
    def vllm_connector(self) -> str: ...
    @property
    def vllm_storage_path(self) -> str | None: ...
    @property
    def vllm_store_max_bytes(self) -> int: ...
    @property
    def vllm_dtype(self) -> str | None: ...


def check_vllm_settings(settings: _Settings) -> None:
    """Refuse invalid ``vllm_*`` values, each error naming its field. Not async.

    The ``*_s`` bounds are checked with the other settings' (positive numbers).

    :raises ConfigError: naming the field.
    """
    if settings.vllm_connector not in CONNECTORS:
        raise ConfigError(
            f"vllm_connector must be one of {', '.join(CONNECTORS)}; "
            f"got {settings.vllm_connector!r}"
        )
    path: object = settings.vllm_storage_path
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"vllm_storage_path must be a folder; got {path!r}")
    budget: object = settings.vllm_store_max_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"vllm_store_max_bytes must be an integer >= 1; got {budget!r}")
    if settings.vllm_dtype is not None:
        if not isinstance(settings.vllm_dtype, str):
            raise ConfigError(f"vllm_dtype must be a dtype name; got {settings.vllm_dtype!r}")
        canonical_dtype(settings.vllm_dtype)
    if (
        settings.wire == "vllm"
        and settings.vllm_connector == "example"
        and settings.vllm_storage_path is None
    ):
        raise ConfigError(
            "vllm_storage_path is needed with vllm_connector='example': the folder the PD's "
            "ECExampleConnector reads (its shared_storage_path)"
        )
