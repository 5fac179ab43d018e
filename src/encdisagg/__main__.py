"""``python -m encdisagg``: the same command line as the ``encdisagg`` script."""

from ._cli import main

raise SystemExit(main())
