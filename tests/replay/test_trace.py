"""Trace readers: Mooncake token synthesis, token and prompt JSONL, text, errors, streaming."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from prefixcache.errors import ConfigError
from prefixcache.replay import ReplayConfig, TraceFormatError, TraceOptions, open_source
from prefixcache.replay.workload.traces import MooncakeTokens, detect_format, read_trace
from prefixcache.text.tokenizers import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


def write_lines(tmp_path: Path, rows: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_equal_ids_give_equal_blocks_and_partial_is_a_head() -> None:
    synth = MooncakeTokens(block_size=512, seed=0)
    a = synth.tokens([7, 8, 9], 3 * 512)
    b = synth.tokens([7, 8, 10], 2 * 512 + 100)
    assert np.array_equal(a[:1024], b[:1024])
    assert not np.array_equal(a[1024:1124], b[1024:1124])
    c = synth.tokens([9], 100)  # id 9 as a partial block: the head of id 9's block
    assert np.array_equal(c, a[1024:1124])
    again = MooncakeTokens(block_size=512, seed=0, max_cached_blocks=2)  # evicting cache
    assert np.array_equal(again.tokens([7, 8, 9], 1536), a)
    assert not np.array_equal(MooncakeTokens(512, seed=1).tokens([7], 512), a[:512])


def test_mooncake_reader_and_block_size_rules(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            {"timestamp": 1500, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 2000, "input_length": 512, "output_length": 0, "hash_ids": [1]},
        ],
    )
    assert detect_format(path) == "mooncake"
    reqs = list(read_trace(path, TraceOptions(trace_block_size=512)))
    assert [len(r.tokens) for r in reqs] == [1000, 512]
    assert [r.arrival_s for r in reqs] == [1.5, 2.0]
    assert [r.output_len for r in reqs] == [3, 0]
    assert np.array_equal(reqs[0].tokens[:512], reqs[1].tokens)
    for block in (16, 64, 256, 512):
        open_source(path, ReplayConfig(block_size=block))
    with pytest.raises(ConfigError, match="does not divide"):
        open_source(path, ReplayConfig(block_size=48))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 10, "hash_ids": [1, 2]}', "2 hash_ids for input_length 10"),
        ('{"input_length": 0, "hash_ids": []}', "'input_length' must be an integer >= 1"),
        ('{"input_length": 10, "hash_ids": [-1]}', "integers >= 0"),
        ('{"input_length": 10, "hash_ids": ["a"]}', "integers >= 0"),
        # id 1 is cached by the good lines before: 1.0 and true are still no hash ids
        ('{"input_length": 10, "hash_ids": [1.0]}', "integers >= 0"),
        ('{"input_length": 10, "hash_ids": [true]}', "integers >= 0"),
        ('{"input_length": 10, "hash_ids": 5}', "must be a list"),
        ('{"input_length": 10, "hash_ids": [1], "timestamp": "x"}', "'timestamp' must be"),
    ],
)
def test_bad_mooncake_line_names_its_line_number(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    path = write_lines(tmp_path, [good, "", good, line, good])
    with pytest.raises(TraceFormatError) as info:
        list(read_trace(path, TraceOptions(format="mooncake")))
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}:4: ") and message in str(info.value)


def test_reading_streams_instead_of_loading_the_file(tmp_path: Path) -> None:
    good = json.dumps({"input_length": 10, "hash_ids": [1]})
    path = write_lines(tmp_path, [good] * 1000 + ["broken"])
    first = list(itertools.islice(read_trace(path), 999))  # the bad last line is never read
    assert len(first) == 999


def test_token_jsonl_with_namespaces(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            {"token_ids": [1, 2, 3], "arrival_s": 0.5, "output_length": 4, "salt": "a"},
            {"input_ids": [1, 2, 3, 4], "n": 2, "adapter": "sql", "model": "m"},
            {"tokens": [5]},
        ],
    )
    assert detect_format(path) == "tokens"
    reqs = list(read_trace(path))
    assert [r.tokens.tolist() for r in reqs] == [[1, 2, 3], [1, 2, 3, 4], [5]]
    assert (reqs[0].arrival_s, reqs[0].output_len, reqs[0].namespace.salt) == (0.5, 4, "a")
    assert (reqs[1].n, reqs[1].namespace.adapter, reqs[1].namespace.model) == (2, "sql", "m")
    assert reqs[2].output_len == 128 and reqs[2].namespace.salt is None
    assert open_source(path).multi_namespace
    bad = write_lines(tmp_path, [{"token_ids": [1, 2**31]}], "bad.jsonl")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1: token ids must be < 2\*\*31"):
        list(read_trace(bad))


@pytest.mark.parametrize("ids", [[1.7, 2.2], [1, "4"], [1, True], [[1, 2]], [-1]])
def test_token_ids_that_are_not_plain_integers_are_refused(tmp_path: Path, ids: list) -> None:
    path = write_lines(tmp_path, [{"token_ids": [1, 2]}, {"token_ids": ids}])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: token ids must be"):
        list(read_trace(path, TraceOptions(format="tokens")))


def test_namespaces_are_found_on_any_line(tmp_path: Path) -> None:
    """A trace is single-namespace only if every record names the same one."""
    later = write_lines(
        tmp_path, [{"token_ids": [1]}] * 3 + [{"token_ids": [2], "salt": "tenant-a"}], "later.jsonl"
    )
    assert open_source(later).multi_namespace
    same = write_lines(
        tmp_path, [{"token_ids": [k + 1], "model": "m"} for k in range(4)], "s.jsonl"
    )
    assert not open_source(same).multi_namespace
    nulls = write_lines(tmp_path, [{"token_ids": [1], "salt": None}, {"token_ids": [2]}], "n.jsonl")
    assert not open_source(nulls).multi_namespace


def test_mooncake_lines_without_an_output_length_take_the_default(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path, [{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}], "m.jsonl"
    )
    (req,) = read_trace(path, TraceOptions(format="mooncake", output_len=200))
    assert req.output_len == 200


CHATML = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_lines_through_the_model_template(tmp_path: Path) -> None:
    (tmp_path / "chatml.jinja").write_text(CHATML)
    turn = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    path = write_lines(tmp_path, [{"messages": turn}])
    options = TraceOptions(chat_template=str(tmp_path / "chatml.jinja"))
    (req,) = read_trace(path, options)
    rendered = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert bytes(req.tokens.astype(np.uint8)).decode() == rendered + "<|im_start|>assistant\n"
    refused = write_lines(
        tmp_path, [{"messages": turn}, {"messages": [{"role": "tool", "content": "x"}]}]
    )
    with pytest.raises(
        TraceFormatError, match=r"t\.jsonl:2: chat template chatml\.jinja: no tools"
    ):
        list(read_trace(refused, options))
    with pytest.raises(ConfigError, match="cannot read chat template"):
        list(read_trace(path, TraceOptions(chat_template=str(tmp_path / "none.jinja"))))


def test_prompt_jsonl_and_text_through_the_byte_tokenizer(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            {"prompt": "héllo", "output_length": 2},
            {"messages": [{"role": "user", "content": "hi"}]},
        ],
    )
    reqs = list(read_trace(path))
    assert reqs[0].tokens.tolist() == list("héllo".encode())
    assert bytes(reqs[1].tokens.astype(np.uint8)).decode() == "<|user|>\nhi\n"
    text = tmp_path / "prompts.txt"
    text.write_text("same prefix one\nsame prefix two\n\n")
    lines = list(read_trace(text))
    assert len(lines) == 2 and lines[0].tokens[:12].tolist() == lines[1].tokens[:12].tolist()
    bad = write_lines(tmp_path, [{"messages": "hi"}], "bad.jsonl")
    with pytest.raises(TraceFormatError, match=r":1: 'messages' must be a list"):
        list(read_trace(bad))
    unknown = write_lines(tmp_path, [{"foo": 1}], "unknown.jsonl")
    with pytest.raises(TraceFormatError, match="unrecognized record"):
        detect_format(unknown)


def test_hugging_face_tokenizer_file(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(path)
    assert loaded.encode("hello world hello").tolist() == [1, 2, 1]
    trace = write_lines(tmp_path, [{"prompt": "world hello"}])
    reqs = list(read_trace(trace, TraceOptions(tokenizer=str(path))))
    assert reqs[0].tokens.tolist() == [2, 1]


def test_tokenizer_errors(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")


def test_shipped_sample_is_a_mooncake_trace() -> None:
    reqs = list(read_trace(SAMPLE))
    assert 200 <= len(reqs) <= 1000
    assert all(len(r.tokens) > 0 for r in reqs)
