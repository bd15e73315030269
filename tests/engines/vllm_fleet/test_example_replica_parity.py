"""The example replica (``examples/fleet/replica.py``), which the fast fleet tests stand on,
answers ``cached_tokens`` as vLLM does: the same prompts, token ids and text, with and without
``cache_salt``, sent to both in the same order.

Token-id prompts are the same tokens on both, so their answers must be equal, number for number.
Text is tokenized by each engine its own way (vLLM's word-level tokenizer, the replica's UTF-8
bytes), so each text answer is checked against the prefix cache both engines claim to be, run
on that engine's own tokens (vLLM's ``/tokenize``): the longest prefix an earlier prompt of the
same salt shares, in whole blocks, the last prompt token always computed.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from real_fleet import BLOCK, MODEL, cached_tokens, complete, wait_for

from prefixcache.engines.vllm import VLLMFleet, VLLMServer, free_port

ROOT = Path(__file__).resolve().parents[3]
REPLICA_VOCAB = 512  # the example's tiny model


@contextlib.contextmanager
def example_replica(log: Path) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable, str(ROOT / "examples" / "fleet" / "replica.py"), "--port", str(port),
        "--model", MODEL, "--block-size", str(BLOCK), "--blocks", "512",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        return False

    try:
        wait_for(up, "the example replica", 120)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % (REPLICA_VOCAB - 3) + 3 for i in range(n)]


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 104729 + 13 * i) % 900}" for i in range(n))


def ideal_answers(prompts: Sequence[tuple[Sequence[int], str | None]]) -> list[int]:
    """What a prefix cache of whole blocks with salts answers, prompt after prompt (nothing
    evicted): the longest full-block prefix shared with an earlier prompt of the same salt,
    at most the blocks before the last token."""
    out = []
    seen: list[tuple[Sequence[int], str | None]] = []
    for tokens, salt in prompts:
        best = 0
        for earlier, their_salt in seen:
            if their_salt != salt:
                continue
            same = 0
            while same < min(len(tokens), len(earlier)) and tokens[same] == earlier[same]:
                same += 1
            best = max(best, same // BLOCK * BLOCK)
        out.append(min(best, (len(tokens) - 1) // BLOCK * BLOCK))
        seen.append((tokens, salt))
    return out


def _tokenized(server: VLLMServer, text: str) -> list[int]:
    answer = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text})
    answer.raise_for_status()
    return list(answer.json()["tokens"])


def test_the_example_replica_reports_cached_tokens_as_vllm_does(
    fleet: VLLMFleet, tmp_path: Path
) -> None:
    server = fleet["vllm-1"]
    a, b = _ids(1, 4 * BLOCK + 5), _ids(2, 3 * BLOCK)
    requests: list[tuple[list[int] | str, str | None]] = [
        (a, None),
        (a, None),  # the whole prompt again: its full blocks
        (a[: 2 * BLOCK + 7] + _ids(3, 40), None),  # a shorter shared prefix
        (a[: 4 * BLOCK], None),  # exactly four blocks: the last one is computed
        (a, "tenant:acme"),  # another salt: nothing
        (a, "tenant:acme"),
        (a[:BLOCK] + _ids(4, 9), "tenant:globex"),
        (b, None),
        (b + _ids(5, BLOCK), None),
        (a[: BLOCK - 1], None),  # less than a block
        (_words(1, 3 * BLOCK), None),
        (_words(1, 3 * BLOCK) + " " + _words(2, 50), None),
        (_words(1, 2 * BLOCK), "tenant:acme"),
        (_words(1, 3 * BLOCK) + " " + _words(3, 20), "tenant:acme"),
    ]
    with example_replica(tmp_path / "replica.log") as replica_url:
        answers = {
            url: [cached_tokens(complete(url, prompt, salt=salt)) for prompt, salt in requests]
            for url in (server.url, replica_url)
        }
    vllm, example = answers[server.url], answers[replica_url]
    ids_only = [i for i, (prompt, _) in enumerate(requests) if not isinstance(prompt, str)]
    assert [example[i] for i in ids_only] == [vllm[i] for i in ids_only]
    # each engine's own tokens, and what a prefix cache of whole salted blocks answers on them
    vllm_tokens = [
        (_tokenized(server, p) if isinstance(p, str) else p, salt) for p, salt in requests
    ]
    replica_tokens = [
        (list(p.encode("utf-8")) if isinstance(p, str) else p, salt) for p, salt in requests
    ]
    assert vllm == ideal_answers(vllm_tokens)
    assert example == ideal_answers(replica_tokens)
    assert sum(vllm) > 0 and sum(example) > 0
