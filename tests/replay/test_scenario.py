"""Scenario files: validation with precise errors, deterministic generation, workload structure."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import numpy as np
import pytest

from prefixcache.replay import ReplayConfig, ScenarioError, Workload, load_scenario, open_source

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml")) + sorted((ROOT / "scenarios").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def take(path: Path, n: int, seed: int | None = None) -> list:
    return list(itertools.islice(Workload(load_scenario(path), seed), n))


BASIC = """\
    seed: 1
    requests: 50
    arrivals: {process: poisson, rate: 10}
    prompt:
      - shared: {name: system, length: 40}
      - unique: {length: {dist: uniform, low: 5, high: 9}}
    output: 16
"""


def test_shipped_scenarios_cover_the_workload_kinds() -> None:
    names = {p.stem for p in SHIPPED}
    for kind in (
        "shared_system_prompt",
        "few_shot",
        "multi_turn_chat",
        "rag",
        "agent_loop",
        "parallel_sampling",
        "multi_tenant",
        "lora_adapters",
    ):
        assert kind in names
    for path in SHIPPED:
        reqs = take(path, 300)
        assert len(reqs) == 300, path
        times = [r.arrival_s for r in reqs]
        assert times == sorted(times), f"{path.name}: arrivals out of order"
        assert all(len(r.tokens) > 0 and r.tokens.dtype == np.dtype("<i4") for r in reqs)


def test_same_seed_same_workload_other_seed_differs(tmp_path: Path) -> None:
    path = write(tmp_path, BASIC)
    a, b = take(path, 50), take(path, 50)
    assert all(
        x.arrival_s == y.arrival_s
        and np.array_equal(x.tokens, y.tokens)
        and x.output_len == y.output_len
        for x, y in zip(a, b, strict=True)
    )
    c = take(path, 50, seed=2)
    assert not np.array_equal(a[1].tokens, c[1].tokens)


def test_shared_segment_is_identical_and_unique_segment_is_fresh(tmp_path: Path) -> None:
    reqs = take(write(tmp_path, BASIC), 50)
    heads = {r.tokens[:40].tobytes() for r in reqs}
    assert len(heads) == 1
    tails = {r.tokens[40:].tobytes() for r in reqs}
    assert len(tails) == 50
    assert {len(r.tokens) - 40 for r in reqs} <= set(range(5, 10))
    assert len(take(write(tmp_path, BASIC), 100)) == 50  # requests bounds the stream


def test_pool_picks_distinct_documents_in_varying_positions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        seed: 3
        requests: 200
        arrivals: {process: constant, rate: 1}
        prompt:
          - pool: {name: docs, size: 5, length: 32, pick: 3, popularity: uniform}
        output: 1
    """,
    )
    reqs = take(path, 200)
    docs: dict[bytes, set[int]] = {}
    for r in reqs:
        assert len(r.tokens) == 96
        chunks = [r.tokens[i * 32 : (i + 1) * 32].tobytes() for i in range(3)]
        assert len(set(chunks)) == 3
        for pos, chunk in enumerate(chunks):
            docs.setdefault(chunk, set()).add(pos)
    assert len(docs) == 5
    assert all(positions == {0, 1, 2} for positions in docs.values())
    assert [r.arrival_s for r in reqs[:3]] == [0.0, 1.0, 2.0]


def test_pool_gives_pick_items_under_skewed_popularity(tmp_path: Path) -> None:
    # size 10, pick 10, zipf 2: drawing 8 x pick times gave about 7.65 distinct items, so
    # prompts were shorter than the scenario says; the rest are drawn without replacement
    path = write(
        tmp_path,
        """\
        seed: 1
        requests: 50
        arrivals: {process: constant, rate: 1}
        prompt:
          - pool: {name: docs, size: 10, length: 16, pick: 10, popularity: {zipf: 2}}
        output: 1
    """,
    )
    for r in take(path, 50):
        assert len(r.tokens) == 160
        assert len({r.tokens[i * 16 : (i + 1) * 16].tobytes() for i in range(10)}) == 10
    # with zero-weight items only the others can be picked
    path = write(
        tmp_path,
        """\
        seed: 1
        requests: 5
        arrivals: {process: constant, rate: 1}
        prompt:
          - pool: {name: docs, size: 4, length: 16, pick: 4, popularity: [1, 1, 0, 1]}
        output: 1
    """,
    )
    assert {len(r.tokens) for r in take(path, 5)} == {48}


def test_heavy_tails_are_cut_at_the_limits_not_cast_from_infinity(tmp_path: Path) -> None:
    # sigma 50 draws infinity: cast to int64 it became a huge negative output (a schema failure)
    # or an empty question (a bogus hit rate)
    path = write(
        tmp_path,
        """\
        seed: 1
        requests: 40
        arrivals: {process: constant, rate: 1}
        prompt:
          - unique: {name: q, length: {dist: lognormal, median: 20, sigma: 50}}
        output: {dist: lognormal, median: 20, sigma: 50}
    """,
    )
    reqs = take(path, 40)
    assert all(0 <= r.output_len <= 1 << 21 for r in reqs)
    assert all(0 <= len(r.tokens) <= 1 << 21 for r in reqs)
    assert max(r.output_len for r in reqs) == 1 << 21  # the tail reached the cap


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    # YAML lets the last one win silently
    path = write(
        tmp_path,
        """\
        seed: 1
        seed: 2
        requests: 5
        arrivals: {process: constant, rate: 1}
        prompt:
          - unique: {name: q, length: 8}
        output: 1
    """,
    )
    with pytest.raises(ScenarioError, match="key 'seed' given twice at line 2"):
        take(path, 5)


def test_a_key_that_is_a_list_is_a_yaml_error_not_a_crash(tmp_path: Path) -> None:
    # the duplicate-key check hashed every key: TypeError (unhashable type: 'list')
    path = write(tmp_path, textwrap.dedent(BASIC) + "? [a]\n: 1\n")
    with pytest.raises(ScenarioError, match=r"valid YAML.*unhashable key"):
        load_scenario(path)


def test_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    # the duplicate-key check must leave '<<: *anchor' alone (the merged keys may be repeated)
    path = write(
        tmp_path,
        """\
        seed: 1
        requests: 5
        arrivals: {process: constant, rate: 1}
        defaults: &q {name: q, length: 8}
        prompt:
          - unique: {<<: *q, length: 12}
        output: 1
    """,
    )
    with pytest.raises(ScenarioError, match="defaults"):  # an unknown key, not a YAML error
        take(path, 5)


def test_sessions_resend_history_and_output(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        seed: 4
        requests: 30
        arrivals: {process: poisson, rate: 0.001}
        prompt:
          - unique: {length: 20}
        session:
          turns: 3
          think_time_s: 1
          turn:
            - unique: {name: msg, length: 7}
        output: 5
    """,
    )
    reqs = take(path, 3)  # sessions arrive rarely: the first three requests are one session
    assert [len(r.tokens) for r in reqs] == [20, 32, 44]
    for prev, cur in itertools.pairwise(reqs):
        assert prev.output_tokens is not None and len(prev.output_tokens) == 5
        history = np.concatenate([prev.tokens, prev.output_tokens])
        assert np.array_equal(cur.tokens[: len(history)], history)
        assert cur.arrival_s == pytest.approx(prev.arrival_s + 1)
    assert reqs[2].output_tokens is None  # the last turn's output is not reused


def test_namespaces_tenants_and_adapters(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        seed: 5
        requests: 400
        arrivals: {process: poisson, rate: 5}
        namespace: {model: m, tenants: 2, adapters: [null, sql], adapter_weights: [1, 3]}
        prompt: [{shared: {length: 16}}]
        output: 1
        n: 3
    """,
    )
    reqs = take(path, 400)
    spaces = {(r.namespace.salt, r.namespace.adapter) for r in reqs}
    assert spaces == {(t, a) for t in ("tenant-0", "tenant-1") for a in (None, "sql")}
    sql = sum(r.namespace.adapter == "sql" for r in reqs) / len(reqs)
    assert 0.65 < sql < 0.85
    assert all(r.n == 3 and r.namespace.model == "m" for r in reqs)


def test_toml_and_yaml_give_the_same_workload(tmp_path: Path) -> None:
    yaml_path = write(tmp_path, BASIC)
    toml_path = write(
        tmp_path,
        """\
        seed = 1
        requests = 50
        output = 16
        arrivals = { process = "poisson", rate = 10 }
        [[prompt]]
        shared = { name = "system", length = 40 }
        [[prompt]]
        unique = { length = { dist = "uniform", low = 5, high = 9 } }
    """,
        "s.toml",
    )
    a, b = take(yaml_path, 50), take(toml_path, 50)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (("seed: 1", "seed: -1"), "seed", "an integer >= 0"),
        (("requests: 50", "requests: many"), "requests", "an integer >= 1"),
        (("rate: 10", "rate: 0"), "arrivals.rate", "a number > 0"),
        (("process: poisson", "process: weibull"), "arrivals.process", "one of poisson"),
        (
            ("shared: {name: system, length: 40}", "shared: {name: system, length: 0}"),
            "prompt[0].shared.length",
            "a number >= 1",
        ),
        (("shared: {name: system", "shard: {name: system"), "prompt[0]", "a segment kind"),
        (("low: 5, high: 9", "low: 5, high: 2"), "prompt[1].unique.length.high", ">= 5"),
        (("dist: uniform", "dist: cauchy"), "prompt[1].unique.length.dist", "one of fixed"),
        (("output: 16", "output: 16\nextra: 1"), "extra", "no such field"),
        (("output: 16", ""), "output", "the field is required"),
        (("rate: 10", "rate: " + "9" * 400), "arrivals.rate", "a finite number"),
        (
            ("length: 40}", "length: 10000000000000000000000000}"),
            "prompt[0].shared.length",
            "a number <= 2,097,152",
        ),
        (("high: 9}", "high: 9, max: 3000000}"), "prompt[1].unique.length.max", "<= 2,097,152"),
        (
            ("{process: poisson, rate: 10}", "{timestamps: [0, 1], rate: 3}"),
            "arrivals.rate",
            "nothing next to timestamps",
        ),
        (("rate: 10}", "rate: 10, cv: 2}"), "arrivals.cv", "only the gamma process"),
        # a min past the cap: every draw was cut below its own minimum
        (("high: 9}", "high: 9, min: 3000000}"), "prompt[1].unique.length.min", "<= 2,097,152"),
        (
            ("{process: poisson, rate: 10}", "{timestamps: [0, 1.0e+300]}"),
            "arrivals.timestamps[1]",
            "a time of at most 1e+12 s",
        ),
    ],
)
def test_malformed_file_names_file_field_and_expectation(
    tmp_path: Path, change: tuple[str, str], field: str, expected: str
) -> None:
    text = textwrap.dedent(BASIC)
    assert change[0] in text
    path = write(tmp_path, text.replace(change[0], change[1]))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert f"field '{field}'" in message and expected in message, message


def test_syntax_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"s\.yaml.*valid YAML.*line 2"):
        load_scenario(write(tmp_path, "seed: 1\nfoo: bar: baz\n"))
    with pytest.raises(ScenarioError, match=r"s\.toml.*valid TOML"):
        load_scenario(write(tmp_path, "seed = = 1\n", "s.toml"))
    with pytest.raises(ScenarioError, match="a mapping"):
        load_scenario(write(tmp_path, "- 1\n- 2\n"))


def test_missing_required_field_is_named_without_internals(tmp_path):
    from prefixcache.replay.workload.input_errors import ScenarioError
    from prefixcache.replay.workload.scenario import load_scenario

    path = tmp_path / "bad.yaml"
    path.write_text("seed: 1\nrequests: 10\nprompt:\n  - unique: {name: q, length: 5}\noutput: 4\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}: field 'arrivals': expected a value (the field is required)"


def test_max_context_caps_every_prompt_of_a_session(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        seed: 1
        requests: 40
        arrivals: {process: poisson, rate: 5}
        prompt: [{unique: {length: 60}}]
        output: 30
        session:
          turns: 5
          think_time_s: 1
          keep_output: true
          max_context: 100
          turn: [{unique: {length: 30}}]
        """,
    )
    assert max(len(r.tokens) for r in take(path, 40)) <= 100


def test_analyze_counts_the_answers_a_session_resends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """analyze's infinite-cache hit rate equals an unbounded replay's on multi-turn sessions:
    both cache each answer, which the next turn's prompt starts with."""
    import json

    from prefixcache.cli import main

    spec = (ROOT / "scenarios" / "multi_turn_chat.yaml").read_text()
    path = tmp_path / "chat.yaml"
    path.write_text(spec.replace("requests: 20000", "requests: 300"))
    assert "requests: 300" in path.read_text()
    out = tmp_path / "run"
    argv = ["--block-size", "16"]
    assert main(["replay", str(path), "--blocks", "inf", "--no-partial-copy", "--out", str(out)]
                + argv) == 0  # fmt: skip
    replayed = json.loads((out / "report.json").read_text())["token_hit_rate"]
    capsys.readouterr()
    assert main(["analyze", str(path), "--format", "json", *argv]) == 0
    analyzed = json.loads(capsys.readouterr().out)
    row = next(r for r in analyzed["infinite_cache"] if r["block_size"] == 16)
    assert row["upper_bound_token_hit_rate"] == pytest.approx(replayed)


def test_timestamps_cut_by_duration_count_the_requests_that_come(tmp_path: Path) -> None:
    path = tmp_path / "stamps.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            seed: 1
            duration_s: 2.5
            arrivals: {timestamps: [0, 1, 2, 3, 4]}
            prompt: [{unique: {name: q, length: 8}}]
            output: 1
            """
        )
    )
    config = ReplayConfig(capacity_blocks=16)
    source = open_source(path, config)
    assert source.total == len(list(source)) == 3  # 0, 1 and 2; 3 is past duration_s
    path.write_text(path.read_text().replace("duration_s: 2.5", "requests: 2\nduration_s: 2.5"))
    source = open_source(path, config)
    assert source.total == len(list(source)) == 2
