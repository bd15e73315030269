"""An engine's own block hashes for a prompt, computed as the engine computes them.

A replica whose events carry hashes this module can reproduce needs no known parent to place a
stored block: a lookup computes the prompt's engine hashes and asks which of them the replica
holds (``unplaced.UnplacedBlocks``).

vLLM (0.33): block ``i`` hashes ``(parent, tuple(tokens of block i), extra_keys)``, the first
block's parent being ``NONE_HASH = hash(seed)`` (the seed a str: ``PYTHONHASHSEED`` when set,
else ``"vllm-none-hash"`` for the SHA-256 variants; the xxHash variants draw a random seed per
process without it, so they are reproducible only with ``PYTHONHASHSEED`` set). The hash of an
object is ``sha256`` or xxh3-128 of its pickle (protocol 5) or of its canonical CBOR encoding
(``--prefix-caching-hash-algo``: ``sha256``, vLLM's default, ``sha256_cbor``, ``xxhash``,
``xxhash_cbor``).
``extra_keys`` is None, or a tuple of tagged keys: ``("lora", name, path)`` on every block of a
LoRA request (the adapter's path is not in the events: it must be configured per adapter, else
LoRA blocks are not computed here), then ``("cache_salt", salt)`` on the first block. Events send
the last 8 bytes of a digest as an unsigned big-endian int (the default) or the digest itself
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

SGLang (0.5): page ``i`` hashes to ``SHA-256(digest of page i-1 || tokens as little-endian
uint32)`` (no prior for the first page, or ``SHA-256("sglang-cache-salt-v1\\0" + salt)`` with a
cache salt); the event value is the first 8 bytes as a signed big-endian int. With EAGLE
speculative decoding (``eagle``) its radix keys are bigrams: page ``i`` hashes the pairs
``(t_j, t_j+1)`` of its positions, so it needs the token after it, and a prompt of ``L`` tokens
has ``(L - 1) // page`` full pages. LoRA blocks depend on an id internal to the engine and are not
computed.

Multimodal keys and prompt embeddings cannot be rebuilt from a prompt's token ids: prompts of a
namespace with ``extra`` entries get no engine hashes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from prefixcache.errors import ConfigError

VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_DEFAULT_ALGO = "sha256"  # vLLM's --prefix-caching-hash-algo when not given (0.32, 0.33)
ENGINES = ("vllm", "sglang")
# what a replica's engine_hash may be named
ENGINE_HASH_NAMES = (
    "vllm",
    *(f"vllm-{algo}" for algo in VLLM_ALGOS),
    "sglang",
    "sglang-sha256",
    "sglang-eagle",
)
DEFAULT_VLLM_SEED = "vllm-none-hash"
_SGLANG_SALT_PREFIX = b"sglang-cache-salt-v1\x00"
_U64 = (1 << 64) - 1

BlockKey = int | bytes  # a block hash in the form an engine's events carry it


# ---- canonical CBOR (RFC 8949 §4.2.1) of the shapes vLLM hashes ---------------------------


def _head(major: int, value: int) -> bytes:
    m = major << 5
    if value < 24:
        return bytes((m | value,))
    if value < 0x100:
        return bytes((m | 24, value))
    if value < 0x10000:
        return bytes((m | 25,)) + value.to_bytes(2, "big")
    if value < 0x1_0000_0000:
        return bytes((m | 26,)) + value.to_bytes(4, "big")
    if value <= _U64:
        return bytes((m | 27,)) + value.to_bytes(8, "big")
    raise ValueError(f"integer {value} does not fit in 64 bits")


def cbor_encode(obj: Any) -> bytes:
    """Canonical CBOR of ``obj``: None, bool, int (64-bit), bytes, str, or a tuple/list of
    these (what ``cbor2.dumps(obj, canonical=True)`` writes for them)."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, (bytes, bytearray)):
        return _head(2, len(obj)) + bytes(obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _head(4, len(obj)) + b"".join(cbor_encode(x) for x in obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as CBOR here")


def cbor_token_items(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The canonical CBOR items of non-negative token ids below 2**32, one after the other, and
    where each starts (one more entry: the end), computed at once."""
    t = tokens.astype(np.int64)
    lens = np.where(t < 24, 1, np.where(t < 0x100, 2, np.where(t < 0x10000, 3, 5)))
    starts = np.zeros(len(t) + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    out = np.zeros(int(starts[-1]), np.uint8)
    s = starts[:-1]
    one = lens == 1
    out[s[one]] = t[one]
    for size, head in ((2, 0x18), (3, 0x19), (5, 0x1A)):
        m = lens == size
        at, v = s[m], t[m]
        out[at] = head
        for k in range(1, size):
            out[at + k] = (v >> (8 * (size - 1 - k))) & 0xFF
    return out.tobytes(), starts


# ---- the hash functions --------------------------------------------------------------------


def _digest(algo: str, data: bytes) -> bytes:
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def vllm_hash(algo: str, obj: Any) -> bytes:
    """vLLM's ``get_hash_fn_by_name(algo)(obj)`` for the objects it hashes."""
    if algo not in VLLM_ALGOS:
        raise ConfigError(f"unknown vLLM hash algorithm {algo!r}; one of {', '.join(VLLM_ALGOS)}")
    data = cbor_encode(obj) if algo.endswith("_cbor") else pickle.dumps(obj, protocol=5)
    return _digest(algo, data)


@dataclass(frozen=True)
class EngineHashSpec:
    """How a replica's engine hashes its blocks (a replica's ``engine_hash`` setting)."""

    engine: str = "vllm"  # "vllm" or "sglang"
    algo: str = VLLM_DEFAULT_ALGO  # vLLM's --prefix-caching-hash-algo (SGLang: "sha256")
    seed: str | None = None  # vLLM: the engine's PYTHONHASHSEED (None: not set)
    int_hashes: bool = True  # vLLM: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (1, the default)
    lora_paths: Mapping[str, str] = field(default_factory=dict)  # vLLM: adapter name -> path
    eagle: bool = False  # SGLang with EAGLE speculative decoding: bigram radix keys

    def label(self) -> str:
        """e.g. ``vllm-sha256_cbor``, ``sglang-eagle``."""
        return f"{self.engine}-eagle" if self.eagle else f"{self.engine}-{self.algo}"


def parse_engine_hash(raw: Any, where: str = "engine_hash") -> EngineHashSpec | None:
    """The spec ``raw`` names: None; a name, ``"vllm"`` (vLLM's default hashing,
    ``VLLM_DEFAULT_ALGO``), ``"vllm-<algo>"`` (another ``--prefix-caching-hash-algo``),
    ``"sglang"`` or ``"sglang-eagle"``; or a mapping with ``engine``, ``algo`` (vLLM's default
    when left out), ``seed``, ``int_hashes``, ``lora_paths``, ``eagle``. ConfigError otherwise."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in ENGINE_HASH_NAMES:
            raise ConfigError(
                f"{where}: unknown engine hashing {raw!r}; one of {', '.join(ENGINE_HASH_NAMES)} "
                f"('vllm' is vLLM's default, --prefix-caching-hash-algo {VLLM_DEFAULT_ALGO}), "
                "or a mapping with engine, algo and seed"
            )
        engine, _, algo = raw.partition("-")
        if engine == "sglang" and algo == "eagle":
            raw = {"engine": engine, "eagle": True}
        else:
            raw = {"engine": engine, **({"algo": algo} if algo else {})}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a name ({', '.join(ENGINE_HASH_NAMES)}) or a mapping")
    unknown = set(raw) - {"engine", "algo", "seed", "int_hashes", "lora_paths", "eagle"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    engine = raw.get("engine", "vllm")
    if engine not in ENGINES:
        raise ConfigError(f"{where}.engine: one of {', '.join(ENGINES)}, got {engine!r}")
    algo = raw.get("algo", VLLM_DEFAULT_ALGO if engine == "vllm" else "sha256")
    seed = raw.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        seed = str(seed)  # YAML reads PYTHONHASHSEED: 0 as an int
    if seed is not None and not isinstance(seed, str):
        raise ConfigError(f"{where}.seed: the engine's PYTHONHASHSEED as a str, got {seed!r}")
    int_hashes = raw.get("int_hashes", True)
    lora_paths = raw.get("lora_paths") or {}
    eagle = raw.get("eagle", False)
    if not isinstance(int_hashes, bool):
        raise ConfigError(f"{where}.int_hashes: expected true or false, got {int_hashes!r}")
    if not isinstance(eagle, bool):
        raise ConfigError(f"{where}.eagle: expected true or false, got {eagle!r}")
    if not isinstance(lora_paths, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in lora_paths.items()
    ):
        raise ConfigError(f"{where}.lora_paths: expected a mapping adapter name -> path")
    if engine == "vllm":
        if eagle:
            raise ConfigError(
                f"{where}.eagle: SGLang only (vLLM's EAGLE lookahead hashing is not reproduced)"
            )
        if algo not in VLLM_ALGOS:
            raise ConfigError(f"{where}.algo: one of {', '.join(VLLM_ALGOS)}, got {algo!r}")
        if algo.startswith("xxhash") and seed is None:
            raise ConfigError(
                f"{where}.seed: vLLM's {algo} is reproducible only with PYTHONHASHSEED set on "
                "the engine; give its value"
            )
    elif algo != "sha256" or seed is not None or lora_paths or not int_hashes:
        raise ConfigError(f"{where}: SGLang hashes with sha256, without seed or LoRA paths")
    return EngineHashSpec(engine, algo, seed, int_hashes, dict(lora_paths), eagle)


class EngineHasher:
    """Computes a prompt's engine block hashes in the form the engine's events carry them."""

    def __init__(self, spec: EngineHashSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        # equal for hashers that hash alike (a memo of hashes may be shared by their replicas)
        kind = (spec.engine, spec.algo, spec.seed, spec.int_hashes, spec.eagle, block_size)
        self.key: tuple[Any, ...] = kind + tuple(sorted(spec.lora_paths.items()))
        if spec.engine == "vllm":
            seed = spec.seed if spec.seed is not None else DEFAULT_VLLM_SEED
            self._none_hash = vllm_hash(spec.algo, seed)

    def supports(self, adapter: str | None, extra: Sequence[str]) -> bool:
        """Whether prompts of this adapter and extra keys can be hashed here."""
        if extra:
            return False
        if adapter is None:
            return True
        return self.spec.engine == "vllm" and adapter in self.spec.lora_paths

    def block_hashes(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        adapter: str | None = None,
        salt: str | None = None,
        limit: int | None = None,
    ) -> list[BlockKey]:
        """The event hashes of the full blocks of ``tokens`` (at most ``limit``), or [] when
        the adapter cannot be hashed (``supports``)."""
        form = self.event_form
        return [form(d) for d in self.digests(tokens, adapter=adapter, salt=salt, limit=limit)]

    def event_form(self, digest: bytes) -> BlockKey:
        """A block's digest as the engine's events carry it."""
        if self.spec.engine == "sglang":
            return int.from_bytes(digest[:8], "big", signed=True)
        return int.from_bytes(digest[-8:], "big") if self.spec.int_hashes else digest

    def digests(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        adapter: str | None = None,
        salt: str | None = None,
        limit: int | None = None,
        start: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The engine's digests of the full blocks ``start..`` of ``tokens`` (at most ``limit``
        blocks in all), ``parent`` being block ``start-1``'s; [] when the adapter cannot be
        hashed (``supports``)."""
        if not self.supports(adapter, ()):
            return []
        p = self.block_size
        eagle = self.spec.eagle  # a page's last bigram needs the token after it
        full = (len(tokens) - 1) // p if eagle else len(tokens) // p
        n = full if limit is None else min(limit, full)
        if start >= n:
            return []
        arr = np.asarray(tokens[start * p : n * p + eagle], dtype=np.int64)
        if self.spec.engine == "sglang":
            return self._sglang(arr, n - start, salt if start == 0 else None, parent)
        return self._vllm(arr, n - start, adapter, salt if start == 0 else None, parent)

    def _vllm(
        self,
        arr: np.ndarray,
        n: int,
        adapter: str | None,
        salt: str | None,
        parent: bytes | None,
    ) -> list[bytes]:
        algo, p = self.spec.algo, self.block_size
        lora = ("lora", adapter, self.spec.lora_paths[adapter]) if adapter is not None else None
        plain = (lora,) if lora is not None else None
        first: tuple[Any, ...] | None = plain
        if parent is None and salt:  # vLLM adds no key for an empty salt
            first = (*(plain or ()), ("cache_salt", salt))
        if parent is None:
            parent = self._none_hash
        else:
            first = plain  # not the prompt's first block
        out: list[bytes] = []
        if not algo.endswith("_cbor"):
            for i in range(n):
                block = tuple(arr[i * p : (i + 1) * p].tolist())
                extra = first if i == 0 else plain
                parent = _digest(algo, pickle.dumps((parent, block, extra), protocol=5))
                out.append(parent)
            return out
        items, starts = cbor_token_items(arr)
        bounds = starts[::p].tolist()
        array_head = b"\x83" + _head(2, len(parent))  # the digests all have its length
        block_head = _head(4, p)
        tail, head_tail = cbor_encode(plain), cbor_encode(first)
        sha = hashlib.sha256 if algo.startswith("sha256") else None
        xxh = xxhash.xxh3_128_digest
        join, append = b"".join, out.append
        for i in range(n):
            data = join(
                (array_head, parent, block_head, items[bounds[i] : bounds[i + 1]],
                 tail if i else head_tail)
            )  # fmt: skip
            parent = sha(data).digest() if sha is not None else xxh(data)
            append(parent)
        return out

    def _sglang(
        self, arr: np.ndarray, n: int, salt: str | None, parent: bytes | None
    ) -> list[bytes]:
        p = self.block_size
        if self.spec.eagle:  # the pairs (t_j, t_j+1), page by page: 2 * p words a page
            words = np.empty(2 * n * p, "<u4")
            words[0::2], words[1::2] = arr[:-1], arr[1:]
            raw, p = words.tobytes(), 2 * p
        else:
            raw = arr.astype("<u4").tobytes()
        prior = parent
        if prior is None:
            prior = (
                hashlib.sha256(_SGLANG_SALT_PREFIX + salt.encode("utf-8")).digest()
                if salt is not None
                else b""
            )
        out: list[bytes] = []
        for i in range(n):
            prior = hashlib.sha256(prior + raw[4 * i * p : 4 * (i + 1) * p]).digest()
            out.append(prior)
        return out
