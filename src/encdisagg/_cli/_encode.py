"""``encdisagg encode URL FILE…``: one request to a running encoder server, printed."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Final, TextIO

import anyio

from .._errors import EncdisaggError
from ..receiver import EncoderClient, PartMetadata, ZmqSendTarget

__all__ = ["guess_modality", "run_encode"]

_EXTENSIONS: Final = {
    "image": {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"},
    "video": {".mp4", ".webm", ".mov", ".mkv", ".avi"},
    "audio": {".wav", ".flac", ".ogg", ".opus", ".mp3"},
}


def guess_modality(path: Path) -> str | None:
    """The modality a file's extension says, if it says one."""
    suffix = path.suffix.lower()
    return next((kind for kind, known in _EXTENSIONS.items() if suffix in known), None)


def run_encode(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """The command: 0 once the server encoded (and delivered) the files, 1 if it refused or
    failed, 2 for files that cannot be read or whose modality is unknown."""
    out = out or sys.stdout
    paths = [Path(name) for name in args.files]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        print(f"encdisagg encode: error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    modality = args.modality or guess_modality(paths[0])
    if modality is None:
        print(
            f"encdisagg encode: error: cannot tell the modality of {paths[0]}; pass --modality",
            file=sys.stderr,
        )
        return 2
    req_id = args.req_id or f"cli-{secrets.token_hex(6)}"
    try:
        metadata, sent = anyio.run(_encode, args, req_id, modality, paths, backend=args.backend)
    except EncdisaggError as exc:
        print(f"encdisagg encode: error: {exc}", file=sys.stderr)
        return 1
    _report(out, args, paths, modality, metadata, sent)
    return 0


async def _encode(
    args: argparse.Namespace, req_id: str, modality: str, paths: list[Path]
) -> tuple[PartMetadata, str | None]:
    timeout = args.timeout_s
    async with EncoderClient(
        [args.url], encode_timeout_s=timeout, send_timeout_s=timeout, api_key=args.api_key
    ) as client:
        plan = client.plan(req_id, {modality: paths})
        (metadata,) = await client.encode(plan)
        if args.keep:
            return metadata, None
        if args.send is None:
            await client.release(plan.parts)
            return metadata, None
        try:
            await client.send(plan.parts[0], ZmqSendTarget(args.send))
        except BaseException:
            await client.release(plan.parts)
            raise
        return metadata, args.send


def _report(
    out: TextIO,
    args: argparse.Namespace,
    paths: list[Path],
    modality: str,
    metadata: PartMetadata,
    sent: str | None,
) -> None:
    rows = list(zip(paths, metadata.token_counts, metadata.grid, strict=False))
    if args.json:
        summary = {
            "req_id": metadata.req_id,
            "modality": modality,
            "items": [
                {"file": str(path), "tokens": tokens, "grid": list(grid)}
                for path, tokens, grid in rows
            ],
            "embedding_len": metadata.embedding_len,
            "embedding_dim": metadata.embedding_dim,
            "embedding_size": metadata.embedding_size,
            "sent_to": sent,
            "kept": args.keep,
        }
        print(json.dumps(summary), file=out)
        return
    width = max(len(str(path)) for path in paths)
    for path, tokens, grid in rows:
        shape = "x".join(str(side) for side in grid)
        print(f"{path!s:<{width}}  {modality}  tokens={tokens}  grid={shape}", file=out)
    if args.keep:
        fate = f"kept: encdisagg receive --from {args.url} {metadata.req_id}"
    else:
        fate = f"sent to {sent}" if sent else "released"
    print(
        f"{metadata.req_id}: {metadata.embedding_len} x {metadata.embedding_dim} "
        f"({metadata.embedding_size} bytes), {fate}",
        file=out,
    )
