"""One line per received part, as ``encdisagg receive`` prints it whether the part was pushed
to it or fetched with ``--from``: what the part says about itself, and a digest of its bytes,
so the digests of two transports can be compared."""

from __future__ import annotations

import hashlib

from ..transfer import ReceivedPart, payload_view

__all__ = ["describe"]


def describe(part: ReceivedPart) -> dict[str, object]:
    """What one received part says about itself, and a digest of its bytes."""
    header = part.header
    line: dict[str, object] = {
        "req_id": header.req_id,
        "part": f"{header.part_idx + 1}/{header.num_parts}",
        "modality": header.modality,
    }
    if part.tensor is None:
        line["error"] = header.error
        line["status"] = header.status
        return line
    digest = hashlib.sha256(payload_view(part.tensor.contiguous())).hexdigest()
    line.update(
        shape=list(header.shape),
        dtype=header.dtype,
        bytes=part.tensor.numel() * part.tensor.element_size(),
        tokens=list(header.token_counts),
        sha256=digest[:16],
    )
    return line
