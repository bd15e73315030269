"""Runs ``prefixcache serve`` under a lowered open-file limit, soft and hard alike (as
``ulimit -n`` sets it), for the tests of what one hostile client can do:

    python -m tests.fleet.service.limited_serve 256 serve --config fleet.yaml --port 8123
"""

from __future__ import annotations

import resource
import sys

from prefixcache.cli import main

if __name__ == "__main__":
    nofile = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    sys.exit(main(sys.argv[2:]))
