import sys

from prefixcache.cli import main

sys.exit(main())
