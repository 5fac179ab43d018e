"""``encdisagg serve`` under a low limit of open descriptors (``python limited_serve.py N
serve ...``): sets ``RLIMIT_NOFILE`` to N, then runs the command line in this process."""

from __future__ import annotations

import resource
import sys

from encdisagg._cli import main

if __name__ == "__main__":
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    sys.exit(main(sys.argv[2:]))
