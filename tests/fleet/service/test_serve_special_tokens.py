"""Text and chat prompts routed on the token ids the engine computes, special tokens included,
over real HTTP (the service and a fake OpenAI upstream in subprocesses on 127.0.0.1).

The model's tokenizer adds a BOS through its post-processor (Llama 3's shape) and its chat
template writes the BOS itself. For each prompt, replica ``a`` is seeded with the ids the engine
computes (vLLM 0.32/0.33; SGLang 0.5.23): a text completion with the BOS (vLLM's
``add_special_tokens``, true by default) or without it when the request says false; a chat as
the template's text with no special token added (one BOS, the template's), or with the
tokenizer's BOS on top of it when the chat request says ``add_special_tokens: true`` (vLLM
renders the template to text, then tokenizes it with the request's value, false by default).
Replica ``b`` is seeded with the other reading of the same prompt.
Routing by prefix must choose ``a`` every time, and a lookup must find ``a``'s blocks only.

A second model, ``s``, is served by replicas configured as SGLang (``engine_hash: sglang``):
SGLang's text completion has no ``add_special_tokens`` and always adds them, so a request that
says false still gets the BOS there, and a chat never does, whatever the request says (``c``
holds that reading, ``d`` the other)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from tests.fleet.fleet_processes import running
from tests.fleet_support import free_port

BLOCK = 4
MODEL = "m"
SGLANG_MODEL = "s"
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
WORDS = ["fleet", "route", "cache", "block", "prefix", "token", "engine", "the", "a", "of"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _tokenizer(folder: Path) -> Tokenizer:
    """A byte-level BPE whose post-processor adds ``<|begin_of_text|>``, as Llama 3's does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(0)
    corpus = [_words(rng, 200) for _ in range(30)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def _rendered(messages: list[dict[str, str]]) -> str:
    """The template's text for ``messages`` with the generation prompt, written out by hand."""
    turns = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
        for m in messages
    )
    return f"<|begin_of_text|>{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"


class Case:
    """One prompt: the body sent, the ids the engine computes (held by replica ``held``) and
    the other reading (held by ``other_held``)."""

    def __init__(
        self,
        path: str,
        body: dict[str, Any],
        engine: list[int],
        other: list[int],
        replicas: tuple[str, str] = ("a", "b"),
    ) -> None:
        assert engine != other and len(engine) >= 4 * BLOCK
        self.path, self.body, self.engine, self.other = path, body, engine, other
        self.held, self.other_held = replicas


def _cases(tok: Tokenizer) -> dict[str, Case]:
    rng = random.Random(1)

    def ids(text: str, add: bool) -> list[int]:
        return list(tok.encode(text, add_special_tokens=add).ids)

    def chat(extra: dict[str, Any], model: str = MODEL, first: str = "system") -> Case:
        messages = [
            {"role": first, "content": _words(rng, 30)},
            {"role": "user", "content": _words(rng, 12)},
        ]
        text = _rendered(messages)
        body = {"model": model, "messages": messages, "max_tokens": 2, **extra}
        added = extra.get("add_special_tokens") is True and model == MODEL  # vLLM's rule
        replicas = ("a", "b") if model == MODEL else ("c", "d")
        path = "/v1/chat/completions"
        return Case(path, body, ids(text, added), ids(text, not added), replicas)

    text = _words(rng, 40)
    unmarked = _words(rng, 40)
    on_sglang = _words(rng, 40)
    return {
        "text": Case(
            "/v1/completions",
            {"model": MODEL, "prompt": text, "max_tokens": 2},
            ids(text, True),
            ids(text, False),
        ),
        "text-without": Case(
            "/v1/completions",
            {"model": MODEL, "prompt": unmarked, "max_tokens": 2, "add_special_tokens": False},
            ids(unmarked, False),
            ids(unmarked, True),
        ),
        "chat": chat({}),
        # vLLM: a BOS on the template's (the other reading, on b, opens unlike the chats above)
        "chat-asking": chat({"add_special_tokens": True}, first="user"),
        "chat-declining": chat({"add_special_tokens": False}),
        "text-sglang": Case(  # SGLang adds them whatever the request says
            "/v1/completions",
            {"model": SGLANG_MODEL, "prompt": on_sglang, "max_tokens": 2},
            ids(on_sglang, True),
            ids(on_sglang, False),
            ("c", "d"),
        ),
        "text-sglang-without": Case(
            "/v1/completions",
            {"model": SGLANG_MODEL, "prompt": on_sglang, "add_special_tokens": False},
            ids(on_sglang, True),
            ids(on_sglang, False),
            ("c", "d"),
        ),
        "chat-sglang-asking": chat({"add_special_tokens": True}, SGLANG_MODEL),  # none added
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict]]:
    tmp = tmp_path_factory.mktemp("special-tokens")
    cases = _cases(_tokenizer(tmp))
    up_port, port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    config = {
        "index": "memory",
        "tokenizer": "tokenizer.json",
        "chat_template": "tokenizer_config.json",
        "routing": {"policy": "prefix"},
        "proxy": {"enabled": True, "timeout_s": 30},
        "health": {"probe_interval_s": None},
        "replicas": [
            {"name": name, "model": MODEL, "block_size": BLOCK, "url": f"{upstream}/{name}"}
            for name in ("a", "b")
        ]
        + [
            {
                "name": name,
                "model": SGLANG_MODEL,
                "block_size": BLOCK,
                "url": f"{upstream}/{name}",
                "engine_hash": "sglang",
            }
            for name in ("c", "d")
        ],
    }
    (tmp / "fleet.yaml").write_text(json.dumps(config))
    seed = [{"replica": c.held, "tokens": c.engine} for c in cases.values()]
    seed += [{"replica": c.other_held, "tokens": c.other} for c in cases.values()]
    (tmp / "seed.json").write_text(json.dumps(seed))
    service = [
        "tests.fleet.service.fleet_launcher",
        "--config", str(tmp / "fleet.yaml"),
        "--port", str(port),
        "--seed", str(tmp / "seed.json"),
    ]  # fmt: skip
    with (
        running(["tests.fleet.service.fake_openai_upstream", "--port", str(up_port)], up_port,
                tmp / "upstream.log"),
        running(service, port, tmp / "service.log") as base,
        httpx.Client(base_url=base, timeout=10.0) as client,
    ):  # fmt: skip
        yield client, cases


ALL_CASES = [
    "text",
    "text-without",
    "chat",
    "chat-asking",
    "chat-declining",
    "text-sglang",
    "text-sglang-without",
    "chat-sglang-asking",
]


@pytest.mark.parametrize("name", ALL_CASES)
def test_the_proxy_routes_on_the_engines_token_ids(fleet: tuple[httpx.Client, dict], name: str):
    client, cases = fleet
    case = cases[name]
    for _ in range(2):  # the second time, the text's ids are held: routed on the event loop
        answer = client.post(case.path, json=case.body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-prefixcache-replica"] == case.held, name


@pytest.mark.parametrize(
    "name",
    ["text", "text-without", "chat", "chat-asking", "text-sglang-without", "chat-sglang-asking"],
)
def test_lookups_tokenize_as_the_engine(fleet: tuple[httpx.Client, dict], name: str) -> None:
    """``/v1/lookup`` (and ``/v1/route``) take a text as the engine's text completion does
    (special tokens added unless ``add_special_tokens`` is false) and messages as its chat
    (none added unless ``add_special_tokens`` is true)."""
    client, cases = fleet
    case = cases[name]
    body: dict[str, Any] = {"model": case.body["model"]}
    if "messages" in case.body:
        body["messages"] = case.body["messages"]
    else:
        body["text"] = case.body["prompt"]
    if "add_special_tokens" in case.body:
        body["add_special_tokens"] = case.body["add_special_tokens"]
    found = client.post("/v1/lookup", json=body).json()
    assert found["prompt_tokens"] == len(case.engine), found
    cached = {r["name"]: r["cached_tokens"] for r in found["replicas"]}
    assert cached == {case.held: len(case.engine) // BLOCK * BLOCK, case.other_held: 0}
    routed = client.post("/v1/route", json=body).json()
    assert routed["replica"] == case.held and routed["prompt_tokens"] == len(case.engine)


def test_a_bad_add_special_tokens_is_a_422(fleet: tuple[httpx.Client, dict]) -> None:
    client, cases = fleet
    for case in (cases["text"], cases["chat"]):
        answer = client.post(case.path, json={**case.body, "add_special_tokens": "yes"})
        assert answer.status_code == 422, answer.text
        assert "add_special_tokens" in answer.json()["error"]["message"]
    answer = client.post("/v1/lookup", json={"model": MODEL, "text": "a", "add_special_tokens": 1})
    assert answer.status_code == 422 and "add_special_tokens" in answer.text
