"""``python -m prefixcache.engines.vllm`` (``make vllm-env``): build vLLM's virtualenv and write
the tiny model where missing."""

import sys

from prefixcache.engines.vllm.install import main

sys.exit(main())
