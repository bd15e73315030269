"""Chat templates rendered as Hugging Face's apply_chat_template renders them; the expected
strings are written out by hand from each template's text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.text.chat_template import ChatTemplate, chat_messages

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3 style: a BOS from the tokenizer config, trimmed contents, a header per turn
LLAMA = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}"
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there  "},
]


def test_chatml_from_a_jinja_file(tmp_path: Path) -> None:
    (tmp_path / "chatml.jinja").write_text(CHATML)
    template = ChatTemplate.load(tmp_path / "chatml.jinja")
    assert template.render(CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n  Hi there  <|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(CHAT, add_generation_prompt=False).endswith("Hi there  <|im_end|>\n")


def test_llama_style_from_a_tokenizer_config(tmp_path: Path) -> None:
    # the layout's whitespace goes (whitespace control, trim_blocks); the BOS is an added token
    config = {
        "chat_template": LLAMA,
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
        "eos_token": "<|eot_id|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(tmp_path / "tokenizer_config.json")
    assert template.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert template.render(CHAT) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_named_templates_take_the_default(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    (tmp_path / "chat_template.json").write_text(json.dumps(config))
    assert ChatTemplate.load(tmp_path / "chat_template.json").render(CHAT) == "D"


def test_continue_final_message() -> None:
    # the text ends right after the last message; its trailing space stays where kept
    partial = [*CHAT, {"role": "assistant", "content": "Sure, "}]
    kept = ChatTemplate(CHATML, {}).render(
        partial, add_generation_prompt=False, continue_final_message=True
    )
    assert kept.endswith("<|im_start|>assistant\nSure, ")
    trimmed = ChatTemplate(LLAMA, {"bos_token": "<s>"}).render(
        partial, add_generation_prompt=False, continue_final_message=True
    )
    assert trimmed.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nSure,")
    empty = [*CHAT, {"role": "assistant", "content": ""}]
    whole = ChatTemplate(CHATML, {}).render(empty, add_generation_prompt=False)
    assert (
        ChatTemplate(CHATML, {}).render(
            empty, add_generation_prompt=False, continue_final_message=True
        )
        == whole
    )
    with pytest.raises(InvalidArgumentError, match="cannot both be true"):
        ChatTemplate(CHATML, {}).render(partial, continue_final_message=True)
    roles_only = ChatTemplate("{% for m in messages %}[{{ m['role'] }}]{% endfor %}", {})
    with pytest.raises(InvalidArgumentError, match="final message"):
        roles_only.render(partial, add_generation_prompt=False, continue_final_message=True)


def test_generation_blocks_and_undefined_tools() -> None:
    # transformers' {% generation %} tag renders its body; tools and documents are none
    source = (
        "{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}no docs|{% endif %}"
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source, {}).render(CHAT) == "no docs|Be brief.  Hi there  "
    assert ChatTemplate(source, {}).render(CHAT, tools=[]).startswith("TOOLS")


def test_jinja_file_takes_special_tokens_from_the_config_beside_it(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    plain = ChatTemplate.load(tmp_path / "chat_template.jinja")
    assert plain.render(CHAT) == "Be brief."
    config = {"bos_token": {"content": "<|begin_of_text|>"}, "additional_special_tokens": ["<x>"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(tmp_path / "chat_template.jinja")
    assert template.render(CHAT) == "<|begin_of_text|>Be brief."
    assert template.special_tokens["additional_special_tokens"] == ["<x>"]


def test_the_template_refuses_a_conversation() -> None:
    template = ChatTemplate(ALTERNATING, {}, "alternating.jinja")
    assert template.render([{"role": "user", "content": "a"}]) == "[user] a\n"
    with pytest.raises(InvalidArgumentError, match=r"alternating\.jinja: Conversation roles"):
        template.render([{"role": "assistant", "content": "a"}])


def test_filters_globals_and_extensions() -> None:
    source = (
        "{{ tools | tojson }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] }}{% endfor %}|{{ strftime_now('%Y') | length }}|{{ flavour }}"
    )
    tools = [{"name": "météo", "z": 1, "a": 2}]
    text = ChatTemplate(source, {}).render(CHAT, tools=tools, extra={"flavour": "plain"})
    # non-ASCII kept and keys in order (transformers' tojson), loop controls, strftime_now
    assert text == '[{"name": "météo", "z": 1, "a": 2}]|Be brief.|4|plain'
    # a function tool in the shape vLLM renders: name, description, parameters, then the rest
    tool = {"function": {"strict": True, "name": "f"}, "type": "function"}
    shaped = ChatTemplate("{{ tools | tojson }}", {}).render(CHAT, tools=[tool])
    assert json.loads(shaped) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "strict": True},
        }
    ]
    assert shaped.index('"name"') < shaped.index('"strict"')


def test_sandbox_and_runtime_failures_are_request_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="chat template"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {}).render(CHAT)
    with pytest.raises(InvalidArgumentError, match="chat template"):
        ChatTemplate("{{ messages[5]['content'] + 1 }}", {}).render(CHAT)


def test_bad_template_files(tmp_path: Path) -> None:
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}\n{{ m['content'] }")
    with pytest.raises(ConfigError, match=r"broken\.jinja: chat template line 2"):
        ChatTemplate.load(tmp_path / "broken.jinja")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ConfigError, match="no 'chat_template'"):
        ChatTemplate.load(tmp_path / "tokenizer_config.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ChatTemplate.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read chat template"):
        ChatTemplate.load(tmp_path / "missing.jinja")


def test_messages_are_checked_and_flattened() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    flat = chat_messages(
        [{"role": "user", "content": parts}, {"role": "assistant", "tool_calls": calls}]
    )
    parsed = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]
    assert flat == [
        {"role": "user", "content": "a\nb"},  # text parts joined by newlines, as vLLM does
        {"role": "assistant", "content": "", "tool_calls": parsed},  # arguments parsed, as vLLM
    ]
    args = [{"function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]
    call = chat_messages([{"role": "assistant", "content": None, "tool_calls": args}])
    assert call[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    bad_args = [{"function": {"name": "f", "arguments": "{nope"}}]
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        chat_messages([{"role": "assistant", "tool_calls": bad_args}])
    for bad, message in [
        ([], "non-empty list"),
        ([{"content": "x"}], "string 'role'"),
        ([{"role": "user", "content": 3}], "messages\\[0\\].content"),
        # a part that is not an object was dropped: the request routed a different prompt
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}], "content\\[1\\]"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            chat_messages(bad)


def test_without_jinja2_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from prefixcache.text import chat_template

    chat_template._environment.cache_clear()
    monkeypatch.setitem(sys.modules, "jinja2", None)
    try:
        with pytest.raises(ConfigError, match=r"need jinja2 \(pip install"):
            ChatTemplate(CHATML, {})
    finally:
        chat_template._environment.cache_clear()


# vision-model style: the template loops over each message's content parts
PARTS = (
    "{% for message in messages %}<{{ message['role'] }}>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[{{ part['type'] }}]{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def test_templates_that_loop_over_content_get_parts() -> None:
    # as vLLM decides: a loop over message['content'] (or .content) means a list of parts
    assert ChatTemplate(PARTS, {}).content_format == "parts"
    dotted = "{% set first = messages[0] %}{% for p in first.content %}{{ p.text }}{% endfor %}"
    assert ChatTemplate(dotted, {}).content_format == "parts"
    assert ChatTemplate(CHATML, {}).content_format == "string"
    assert ChatTemplate(LLAMA, {}).content_format == "string"
    loop_elsewhere = (
        "{% for m in messages %}{% for c in m['role'] %}{{ c }}{% endfor %}{% endfor %}"
    )
    assert ChatTemplate(loop_elsewhere, {}).content_format == "string"
    template = ChatTemplate(PARTS, {})
    asked = [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [
            {"type": "text", "text": "look:"},
            {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "text", "text": "what is it?"},
        ]},
    ]  # fmt: skip
    flat = chat_messages(asked, template.content_format)
    assert flat[0]["content"] == [{"type": "text", "text": "plain"}]
    assert [p["type"] for p in flat[1]["content"]] == ["text", "image", "text"]
    text = template.render(flat, add_generation_prompt=False)
    assert text == "<user>plain<user>look:[image]what is it?"
    partial = [*flat, {"role": "assistant", "content": [{"type": "text", "text": "A cat "}]}]
    cut = template.render(partial, add_generation_prompt=False, continue_final_message=True)
    assert cut.endswith("<assistant>A cat ")
