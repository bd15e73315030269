"""``proxy.forward_token_ids``: a text completion reaches the replica with the token ids the service
computed as its prompt (its special tokens as the engine adds them), whether the text was new,
seen before or grown; anything that needs the text itself (echo, a suffix, truncation, several
prompts), a chat and a prompt of token ids go on as they came; off unless the config says so.
That real vLLM answers such a request as it answers the text is checked against real servers
(tests/engines/vllm_fleet/test_real_token_ids.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from prefixcache.errors import ConfigError
from prefixcache.fleet.service.openai_proxy.proxy import TEXT_ONLY_FIELDS
from tests.fleet.service.serve_harness import MODEL, Replicas, make_app, make_config

WORDS = [f"w{i}" for i in range(40)]


def _tokenizer(folder: Path) -> Path:
    """Words ``w0..w39`` as ids 3..42, a BOS (id 1) before every prompt."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _ids(text: str, bos: bool = True) -> list[int]:
    return ([1] if bos else []) + [int(w[1:]) + 3 for w in text.split()]


Request = tuple[str, dict[str, Any]]  # path, body


def _forwarded(tmp_path: Path, forward: bool | None, bodies: list[Request]) -> list[dict[str, Any]]:
    """What the replica received for each request, with ``proxy.forward_token_ids`` as given
    (None: not in the config)."""
    proxy: dict[str, Any] = {} if forward is None else {"forward_token_ids": forward}
    extra = {"proxy": proxy, "tokenizer": str(_tokenizer(tmp_path))}
    app, _ = make_app(make_config(tmp_path, keys=False, proxy=True, extra=extra))
    replicas = Replicas()
    with TestClient(app) as client:
        app.state.service.http_client = replicas.client()
        for path, body in bodies:
            answer = client.post(path, json={"model": MODEL, "max_tokens": 1, **body})
            assert answer.status_code == 200, answer.text
        assert app.state.service.router.in_flight() == 0
    return [seen for seen, _ in replicas.seen]


TEXT = " ".join(WORDS[i % 40] for i in range(700))  # past the tokenizer cache's first cut


def test_text_completions_go_on_as_the_services_token_ids(tmp_path: Path) -> None:
    grown = TEXT + " w7 w8"
    bodies: list[Request] = [
        ("/v1/completions", {"prompt": TEXT}),  # first sight: tokenized in the thread pool
        ("/v1/completions", {"prompt": TEXT, "cache_salt": "s"}),  # seen: ids held
        ("/v1/completions", {"prompt": grown}),  # continued: the new words tokenized
        ("/v1/completions", {"prompt": "w1 w2", "add_special_tokens": False}),
        ("/v1/completions", {"prompt": "w3", "stream": True, "echo": False}),
    ]
    got = _forwarded(tmp_path, True, bodies)
    assert got[0] == {"model": MODEL, "max_tokens": 1, "prompt": _ids(TEXT)}
    assert got[1]["prompt"] == _ids(TEXT) and got[1]["cache_salt"] == "s"
    assert got[2]["prompt"] == _ids(grown)
    assert got[3]["prompt"] == _ids("w1 w2", bos=False) and got[3]["add_special_tokens"] is False
    assert got[4]["prompt"] == _ids("w3") and got[4]["stream"] is True


def test_what_needs_the_text_chat_and_token_ids_go_on_as_they_came(tmp_path: Path) -> None:
    text_only: list[Request] = [
        ("/v1/completions", {"prompt": "w1 w2", name: value})
        for name, value in zip(TEXT_ONLY_FIELDS, (True, " w9", 1, "AAAA", True), strict=True)
    ]
    others: list[Request] = [
        ("/v1/completions", {"prompt": ["w1 w2", "w3"]}),
        ("/v1/completions", {"prompt": [5, 6, 7]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2"}]}),
    ]
    got = _forwarded(tmp_path, True, text_only + others)
    for (_, body), seen in zip(text_only + others, got, strict=True):
        assert seen == {"model": MODEL, "max_tokens": 1, **body}


@pytest.mark.parametrize("forward", [None, False])
def test_off_unless_the_config_says_so(tmp_path: Path, forward: bool | None) -> None:
    got = _forwarded(tmp_path, forward, [("/v1/completions", {"prompt": TEXT})] * 2)
    assert [seen["prompt"] for seen in got] == [TEXT, TEXT]


def test_the_setting_is_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"proxy\.forward_token_ids"):
        make_config(tmp_path, keys=False, proxy=True, extra={"proxy": {"forward_token_ids": 1}})
