"""SGLang 0.5.23's own modules, from its wheel, in vLLM's virtualenv (which has torch and most of
what they import): its host memory pool, its storage backend factory and its cache controller's
storage calls. Nothing of SGLang's vision models runs, so ``torchvision`` (absent there: vLLM's
environment removes the CUDA build) is an inert placeholder, as tests/engine_wheels.py makes
them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/, for engine_wheels
from engine_wheels import _Placeholder

# SGLang's package first: it imports transformers, which then finds no torchvision, as it is
pytest.importorskip("sglang", reason="runs with SGLang's wheel: test_hicache_in_sglang.py")
for _name in (
    "torchvision",
    "torchvision.io",
    "torchvision.ops",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
):
    sys.modules.setdefault(_name, _Placeholder(_name))
