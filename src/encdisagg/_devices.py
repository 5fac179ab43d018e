"""Device and dtype names: checked when a config is built, resolved per data-parallel worker.

The syntax checks import nothing heavy (a config is built before torch is needed); only
:func:`check_device_present` and :func:`worker_devices` ask torch which accelerators this
machine has, and only for accelerator devices.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Final

from ._errors import ConfigError

__all__ = [
    "CANONICAL_DTYPES",
    "DEVICE_TYPES",
    "DTYPE_NAMES",
    "check_device",
    "check_device_present",
    "check_dtype",
    "worker_devices",
]

#: Device types a model may run on (torch's names).
DEVICE_TYPES: Final = ("cpu", "cuda", "mps", "xpu")
#: Each accepted floating ``dtype`` spelling -> its ``torch`` attribute name.
CANONICAL_DTYPES: Final = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "double": "float64",
}
#: Accepted ``dtype`` spellings (``torch.`` prefix allowed); ``auto``: the checkpoint's own.
DTYPE_NAMES: Final = ("auto", *CANONICAL_DTYPES)
_DEVICE: Final = re.compile(r"(?P<type>[a-z]+)(?::(?P<index>\d{1,3}))?")


def check_device(device: object, field: str = "device") -> str:
    """``device`` if it names a device torch can place a model on (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, ``"mps"``, ``"xpu:0"``); does not check that the device exists. Not async.

    :raises ConfigError: naming ``field`` for anything else (``"tpu"``, ``"cuda:x"``).
    """
    match = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is None or match["type"] not in DEVICE_TYPES:
        raise ConfigError(
            f"{field} must be one of {', '.join(DEVICE_TYPES)}, optionally with an index "
            f"(cuda:1); got {device!r}"
        )
    if match["type"] == "cpu" and match["index"] not in (None, "0"):
        raise ConfigError(f"{field}: cpu has no index {match['index']}; got {device!r}")
    return device  # type: ignore[return-value]  # matched a str above


def check_dtype(
    dtype: object, field: str = "dtype", names: Collection[str] = DTYPE_NAMES
) -> str | None:
    """Accept ``None`` or a dtype name of ``names`` (spellings of :data:`DTYPE_NAMES`,
    ``torch.`` prefix allowed); return the name as a torch attribute (``"bf16"`` ->
    ``"bfloat16"``, ``"auto"`` as is), or ``None``. Not async.

    :raises ConfigError: naming ``field`` for anything else.
    """
    if dtype is None:
        return None
    name = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else ""
    if name not in names:
        raise ConfigError(f"{field} must be one of {', '.join(names)} (or null); got {dtype!r}")
    return CANONICAL_DTYPES.get(name, name)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device_present(device: str, field: str = "device") -> None:
    """Refuse a CUDA device this machine does not have (no CUDA, or the index is past the
    visible devices). Other types are left to the model's loading. Blocks briefly (torch
    counts the devices once).

    :raises ConfigError: naming ``field`` and what is visible.
    """
    match = _DEVICE.fullmatch(check_device(device, field))
    assert match is not None
    if match["type"] != "cuda":
        return
    count = _cuda_count()
    if count == 0:
        raise ConfigError(f"{field}: {device!r} asked for, but torch sees no CUDA device")
    if match["index"] is not None and int(match["index"]) >= count:
        raise ConfigError(
            f"{field}: {device!r} asked for, but torch sees {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1})"
        )


def worker_devices(device: str, workers: int, devices: Sequence[str] | None) -> tuple[str, ...]:
    """The device of each of ``workers`` data-parallel workers.

    ``devices`` (``--devices``) lists one entry per worker: a bare index (``"1"``) means that
    index of ``device``'s accelerator type (CUDA when ``device`` is the CPU), anything else
    is a device name. Without it, a bare ``"cuda"`` with several workers gives worker
    ``rank`` ``cuda:{rank}`` (so each has its own GPU); any other ``device`` is shared by
    every worker. Every CUDA device is checked to exist. Blocks briefly (see
    :func:`check_device_present`).

    :raises ConfigError: naming ``devices`` (or ``device``) for a wrong count, a bad
        entry, a missing GPU, or more workers than GPUs when assigning them by default.
    """
    check_device(device)
    kind = device.partition(":")[0]
    if devices is not None:
        if len(devices) != workers:
            raise ConfigError(
                f"devices lists {len(devices)} device(s) for {workers} data-parallel "
                f"worker(s); give one per worker (repeat one to share it)"
            )
        accelerator = kind if kind != "cpu" else "cuda"
        chosen = tuple(
            f"{accelerator}:{entry.strip()}" if entry.strip().isdigit() else entry.strip()
            for entry in devices
        )
    elif kind == "cuda" and device == "cuda" and workers > 1:
        count = _cuda_count()
        if count < workers:
            raise ConfigError(
                f"devices: {workers} data-parallel workers on 'cuda' need a GPU each, but "
                f"torch sees {count}; pass devices (--devices 0,0,1,1) to share GPUs"
            )
        chosen = tuple(f"cuda:{rank}" for rank in range(workers))
    else:
        chosen = (device,) * workers
    for entry in chosen:
        check_device_present(entry, "devices" if devices is not None else "device")
    return chosen
