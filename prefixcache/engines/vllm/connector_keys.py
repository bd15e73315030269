"""Store keys for vLLM requests: prefixcache's block digests, under the namespace the fleet
service routes the request in.

The namespace is the service's for an OpenAI request to a vLLM replica: ``model`` (the served
model name, or the connector's ``model`` setting), the LoRA adapter's name as ``adapter``, the
request's ``cache_salt`` as ``salt``, and the replica's ``extra`` keys, plus the exact weights
when named (``weights``: servers of one model name with other weights never share a record).
Each full block of the prompt is keyed by its chained digest (``BlockHasher``, ``xxh3_128``
unless set); without ``weights`` it is the digest the service computes for the same prompt (the
service itself places a server's store blocks by vLLM's block hashes, either way).
Multimodal prompts and prompt embeddings are not keyed (their K/V depends on more than token
ids): such requests neither load nor save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.store.block_record import namespace_fingerprint

_FINGERPRINTS = 4096  # namespaces whose record fingerprint is kept


class PromptKeys(NamedTuple):
    """A request's store keys: one digest per full prompt block, from the first."""

    namespace: Namespace
    fingerprint: bytes  # the namespace's fingerprint in a record header
    digests: list[bytes]


def request_namespace(
    model: str, weights: str | None, extra: tuple[str, ...], request: Any
) -> Namespace | None:
    """The namespace of a vLLM ``Request`` (None: its blocks are not keyed: multimodal input
    or prompt embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    if getattr(request, "prompt_token_ids", None) is None:
        return None
    lora = getattr(request, "lora_request", None)
    adapter = None if lora is None else str(lora.lora_name)
    salt = getattr(request, "cache_salt", None)
    return Namespace(model=model, adapter=adapter, salt=salt, extra=extra, weights=weights)


class PromptKeyMaker:
    """Digests of prompts in blocks of ``block_size`` tokens."""

    def __init__(self, block_size: int, hash_algo: str) -> None:
        self.hasher = BlockHasher(block_size, hash_algo)
        self.block_size = block_size
        self._fingerprints: dict[Namespace, bytes] = {}

    def fingerprint(self, namespace: Namespace) -> bytes:
        """The namespace's fingerprint, as records carry it."""
        fp = self._fingerprints.get(namespace)
        if fp is None:
            if len(self._fingerprints) >= _FINGERPRINTS:
                self._fingerprints.clear()
            fp = self._fingerprints[namespace] = namespace_fingerprint(namespace)
        return fp

    def keys(self, namespace: Namespace, prompt: Sequence[int]) -> PromptKeys:
        """The digest of every full block of ``prompt`` in ``namespace``."""
        digests = self.hasher.hash_prompt(prompt, namespace)
        return PromptKeys(namespace, self.fingerprint(namespace), digests)
