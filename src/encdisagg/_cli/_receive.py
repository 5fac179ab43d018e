"""``encdisagg receive``: a ZMQ PULL endpoint that prints each embedding part it receives
(with ``--from``, the parts it fetches: :mod:`._receive_staged`)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import TextIO

import anyio

from .._errors import EncdisaggError
from ..transfer import ZmqReceiver
from ._describe import describe

__all__ = ["run_receive"]


def run_receive(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """The command: 0 once it stopped (count reached, idle, Ctrl-C), 1 if binding failed
    or (with ``--from``) a part could not be fetched, 2 for flags that do not fit."""
    out = out or sys.stdout
    if args.source is not None or args.part_ids or args.transfer != "zmq":
        return _run_fetch(args, out)
    try:
        anyio.run(_receive, args, out, backend=args.backend)
    except KeyboardInterrupt:
        pass
    except EncdisaggError as exc:
        print(f"encdisagg receive: error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _receive(args: argparse.Namespace, out: TextIO) -> None:
    async with ZmqReceiver(args.bind) as receiver:
        print(f"receiving on {receiver.url}", file=out, flush=True)
        received = 0
        while args.count is None or received < args.count:
            with anyio.move_on_after(args.timeout_s or float("inf")) as idle:
                try:
                    part = await receiver.receive()
                except EncdisaggError as exc:  # a malformed message: said, then the next one
                    print(f"malformed message: {exc}", file=out, flush=True)
                    continue
            if idle.cancelled_caught:
                print(f"idle for {args.timeout_s:g} s: stopping", file=out, flush=True)
                return
            received += 1
            _print(describe(part), args.json, out)


def _run_fetch(args: argparse.Namespace, out: TextIO) -> int:
    if args.source is None or not args.part_ids:
        print(
            "encdisagg receive: error: part ids and --transfer mooncake go with --from URL "
            "PART_ID... (parts kept staged by encdisagg encode --keep)",
            file=sys.stderr,
        )
        return 2
    from ._receive_staged import fetch_staged, staged_part

    try:
        parts = [staged_part(args.source, part_id) for part_id in args.part_ids]
    except ValueError as exc:
        print(f"encdisagg receive: error: {exc}", file=sys.stderr)
        return 2
    show = functools.partial(_print, as_json=args.json, out=out)
    try:
        failed = anyio.run(fetch_staged, args, parts, show, backend=args.backend)
    except KeyboardInterrupt:
        return 1
    except EncdisaggError as exc:
        print(f"encdisagg receive: error: {exc}", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _print(fields: dict[str, object], as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(fields), file=out, flush=True)
    else:
        text = "  ".join(f"{key}={value}" for key, value in fields.items())
        print(text.replace(", ", ","), file=out, flush=True)
