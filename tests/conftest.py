"""Test configuration. The Triton interpreter must be enabled before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
