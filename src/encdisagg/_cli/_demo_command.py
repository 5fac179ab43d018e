"""``encdisagg demo``: the parsed options to :class:`DemoOptions`, run, print, exit status."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path

import anyio

from .._devices import check_device_present
from .._errors import BadRequestError
from ..pipeline._demo import DemoOptions, run_demo
from ..pipeline._lm import BUILTIN_LANGUAGE_MODELS

__all__ = ["run_demo_command"]


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo; 0 if every check passed, 1 if one failed, 2 for bad options."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    # Each option named like a DemoOptions field sets it; those left out keep its default.
    names = [field.name for field in fields(DemoOptions)]
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    model = values.get("model", "tiny")
    if model not in BUILTIN_LANGUAGE_MODELS and not Path(model).expanduser().is_dir():
        builtins = ", ".join(repr(name) for name in BUILTIN_LANGUAGE_MODELS)
        print(
            f"encdisagg demo: --model {model!r} is neither a built-in model ({builtins}) "
            "nor a folder",
            file=sys.stderr,
        )
        return 2
    try:
        options = DemoOptions(verbose=not args.quiet, **values)
        # A CUDA device this machine lacks: refused here, not by every encoder's model load.
        check_device_present(options.device)
    except BadRequestError as exc:
        print(f"encdisagg demo: {exc}", file=sys.stderr)
        return 2
    try:
        report = anyio.run(run_demo, options, backend=args.backend)
    except KeyboardInterrupt:
        return 130
    print(report.summary_line())
    sys.stdout.flush()
    return 0 if report.ok else 1
