"""Write a workload's requests in formats that real serving benchmarks read.

- ``mooncake``: the Mooncake trace JSONL (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids``), one id per ``block_size``-token block of the prompt. Equal ids
  mean equal prefixes: the id of a block is given by the whole prefix up to its end, so two
  prompts share ids exactly as far as they share blocks. The format has no parallel samples:
  a request with ``n`` samples is written as ``n`` equal lines (same arrival, same prompt), as a
  benchmark must send it to get ``n`` completions.
- ``openai-jsonl``: the OpenAI batch request format (``custom_id``, ``method``, ``url``, ``body``)
  of ``/v1/completions`` requests whose ``prompt`` is the token ids, as vLLM's ``run_batch``
  accepts. The format has no arrival time, so it goes in ``custom_id`` (``req-<index>-t<ms>``);
  the lines are in arrival order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator

from prefixcache.replay.workload.request import Request

FORMATS = ("mooncake", "openai-jsonl")  # the names the export command takes


def mooncake_lines(requests: Iterable[Request], block_size: int = 512) -> Iterator[str]:
    """One Mooncake trace line (JSON, no newline) per request, ``n`` equal lines for ``n``
    parallel samples. ``block_size``: prompt tokens per hash id. Ids are numbered from 0 in
    order of first appearance and depend on the namespace too, so requests of different
    namespaces never share one; ``timestamp`` is the arrival in whole milliseconds."""
    ids: dict[bytes, int] = {}
    for req in requests:
        tokens = req.tokens
        digest = req.namespace.label().encode()
        hash_ids = []
        for start in range(0, len(tokens), block_size):
            block = tokens[start : start + block_size]
            digest = hashlib.blake2b(digest + block.tobytes(), digest_size=16).digest()
            hash_ids.append(ids.setdefault(digest, len(ids)))
        line = json.dumps(
            {
                "timestamp": round(req.arrival_s * 1000),
                "input_length": len(tokens),
                "output_length": req.output_len,
                "hash_ids": hash_ids,
            }
        )
        for _ in range(req.n):
            yield line


def openai_lines(requests: Iterable[Request], model: str, vocab_size: int) -> Iterator[str]:
    """One OpenAI batch line (JSON, no newline) per request: a ``/v1/completions`` request
    for ``model`` whose prompt is the token ids taken modulo ``vocab_size`` (so the server's
    tokenizer accepts them; equal prompts stay equal), ``max_tokens`` the output length and
    ``n`` when above 1. The namespace is not written."""
    for i, req in enumerate(requests):
        body: dict[str, object] = {
            "model": model,
            "prompt": (req.tokens % vocab_size).tolist(),
            "max_tokens": req.output_len,
        }
        if req.n > 1:
            body["n"] = req.n
        yield json.dumps(
            {
                "custom_id": f"req-{i}-t{round(req.arrival_s * 1000)}",
                "method": "POST",
                "url": "/v1/completions",
                "body": body,
            }
        )
