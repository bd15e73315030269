"""Chat prompts as the engine sees them: the model's Jinja chat template, rendered the way
Hugging Face ``apply_chat_template`` renders it (and vLLM and SGLang with it).

Routing a chat request on the prefix a replica has cached needs the exact token ids the engine
will compute, and those come from the model's template: system prompt, role markers, special
tokens. The template is read from a ``.jinja`` file, or from the ``chat_template`` field of a
``tokenizer_config.json`` / ``chat_template.json`` (which also give ``bos_token`` and
``eos_token``). The environment matches ``transformers``: sandboxed, ``trim_blocks`` and
``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII text and key order,
``raise_exception`` and ``strftime_now``. The rendered text is tokenized without adding special
tokens, as vLLM does for chat requests (the template writes them).

Without a template the service falls back to a neutral rendering (role tag, content): equal
conversations still give equal tokens, but not the engine's, so routing then sees only what
requests it routed itself have in common, never what the replicas report holding.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, InvalidArgumentError

_SPECIAL = (  # the special tokens a tokenizer config may hand a template
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The template's ``tojson`` filter, as transformers defines it: non-ASCII kept."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """The template's ``strftime_now(fmt)``: the local time now, formatted."""
    return datetime.now().strftime(fmt)


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens a tokenizer config gives a template (an added token is a dict with
    its text under ``content``)."""

    def text(value: Any) -> Any:
        return value.get("content") if isinstance(value, dict) else value

    out: dict[str, Any] = {}
    for key in _SPECIAL:
        value = text(config.get(key))
        if isinstance(value, str):
            out[key] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(text, extra) if isinstance(t, str)]
    return out


def _read_json(path: Path) -> Any:
    """A JSON file's value; ConfigError when it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read chat template {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


@functools.cache
def _environment() -> Any:
    """The Jinja environment transformers renders chat templates in (built once); ConfigError
    when jinja2 is not installed."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError(
            "chat templates need jinja2 (pip install 'prefixcache[service]')"
        ) from None

    def raise_exception(message: str) -> None:
        """The template's ``raise_exception(message)``: refuses the conversation."""
        raise jinja2.exceptions.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks
        in transformers): renders its body unchanged."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template (Jinja ``source``) and the special tokens it may use, by name
    (``bos_token``: ``"<s>"``, ...); ``name`` identifies it in errors. ``content_format`` is
    ``"parts"`` when the template loops over a message's content (then ``chat_messages`` must
    hand it content as a list of parts), else ``"string"``. Raises ConfigError when jinja2 is
    not installed or the source is not a valid template."""

    def __init__(self, source: str, special_tokens: dict[str, Any], name: str = "<template>"):
        env = _environment()  # a clear ConfigError without jinja2
        import jinja2

        try:
            self._template = env.from_string(source)
            tree = env.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{name}: chat template line {exc.lineno}: {exc.message}") from None
        self.name = name
        self.special_tokens = dict(special_tokens)
        # "parts" when the template loops over a message's content (vLLM's "openai" content
        # format: content is then a list of parts), else "string"
        self.content_format = "parts" if _loops_over_content(tree) else "string"

    @classmethod
    def load(cls, path: str | Path) -> ChatTemplate:
        """From the ``chat_template`` of a JSON tokenizer config (its default one where it
        lists several), or from a ``.jinja`` file (as models ship ``chat_template.jinja``),
        with the special tokens of the ``tokenizer_config.json`` beside it if there is one.
        Raises ConfigError when a file cannot be read or is not JSON, a JSON config has no
        template string, or the template does not compile (or jinja2 is not installed)."""
        path = Path(path)
        if path.suffix == ".json":
            config = _read_json(path)
            source = config.get("chat_template") if isinstance(config, dict) else None
            if isinstance(source, list):  # named templates: the default one
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
            if not isinstance(source, str):
                raise ConfigError(f"{path}: no 'chat_template' string (or list with a 'default')")
            return cls(source, _special_tokens(config), path.name)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read chat template {path}: {exc}") from None
        beside = path.with_name("tokenizer_config.json")
        config = _read_json(beside) if beside.is_file() else {}
        return cls(source, _special_tokens(config if isinstance(config, dict) else {}), path.name)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation (``messages`` as ``chat_messages`` shapes them).
        ``add_generation_prompt`` has the template end it with the assistant's turn header;
        ``continue_final_message`` instead ends the text right after the last message's
        content (no end-of-turn marker), so the model continues it; trailing spaces stay where
        the template kept them. ``tools`` (function tools shaped as vLLM hands them) and
        ``documents`` go to the template as given (None: none); ``extra`` adds template
        variables (over the special tokens).

        Raises InvalidArgumentError when both ``add_generation_prompt`` and
        ``continue_final_message`` are true, the template refuses the conversation (a
        ``raise_exception``) or fails on it, or (continuing) the final message's content is not
        in the rendered text."""
        import jinja2

        if add_generation_prompt and continue_final_message:
            raise InvalidArgumentError(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        context = {**self.special_tokens, **(extra or {})}
        context.update(
            messages=messages,
            tools=None if tools is None else [_tool(t) for t in tools],
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            text = self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"chat template {self.name}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"chat template {self.name} failed on these messages: {exc}"
            ) from None
        if continue_final_message:  # end right after the last message's content
            final = messages[-1].get("content") if messages else None
            if isinstance(final, list):  # parts: the last one with text
                texts = [p.get("text") for p in final if isinstance(p, dict) and "text" in p]
                final = texts[-1] if texts else ""
            final = final if isinstance(final, str) else ""
            if final.strip() not in text:
                raise InvalidArgumentError(
                    "continue_final_message: the final message's content is not in the prompt "
                    "the chat template rendered"
                )
            # as transformers' apply_chat_template cuts it, which engines use, quirks included: a
            # final message that starts with whitespace loses its trailing space here too, and
            # the prompt must be the engine's, token for token, for its blocks to be the same
            at = text.rindex(final.strip())
            if text[at : at + len(final.lstrip())] == final:  # the template kept its spacing
                text = text[: at + len(final.lstrip())]
            else:  # the template trimmed it
                text = text[: at + len(final.strip())]
        return text


def _tool(tool: Any) -> Any:
    """A function tool in the shape vLLM hands it to the template (its request model dumped):
    ``type`` then ``function`` with ``name``, ``description`` and ``parameters`` (None when
    absent), then any other fields; other tools as given."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    fn = tool["function"]
    shaped = {"name": fn.get("name"), "description": fn.get("description")}
    shaped["parameters"] = fn.get("parameters")
    shaped.update((k, v) for k, v in fn.items() if k not in shaped)
    rest = {k: v for k, v in tool.items() if k not in ("type", "function")}
    return {"type": tool.get("type", "function"), "function": shaped, **rest}


def _loops_over_content(tree: Any) -> bool:
    """Whether a template iterates over a message's content (``for part in
    message['content']`` or ``message.content``, ``message`` taken from ``messages``), the
    test vLLM uses to hand content to a template as a list of parts."""
    from jinja2 import nodes

    def field_of(node: Any, names: set[str], key: str) -> bool:
        if isinstance(node, nodes.Getitem):
            return (
                isinstance(node.node, nodes.Name)
                and node.node.name in names
                and isinstance(node.arg, nodes.Const)
                and node.arg.value == key
            )
        if isinstance(node, nodes.Getattr):
            return (
                isinstance(node.node, nodes.Name) and node.node.name in names and node.attr == key
            )
        return False

    def is_messages(node: Any) -> bool:
        return isinstance(node, nodes.Name) and node.name == "messages"

    names: set[str] = set()  # variables that hold a message
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and (
            is_messages(loop.iter)
            or (isinstance(loop.iter, nodes.Getitem) and is_messages(loop.iter.node))
            or (isinstance(loop.iter, nodes.Filter) and is_messages(loop.iter.node))
        ):
            names.add(loop.target.name)
    for assign in tree.find_all(nodes.Assign):  # {% set message = messages[0] %}
        target, value = assign.target, assign.node
        taken = isinstance(value, nodes.Getitem) and is_messages(value.node)
        if isinstance(target, nodes.Name) and taken:
            names.add(target.name)
    return any(field_of(loop.iter, names, "content") for loop in tree.find_all(nodes.For))


def _parts(content: Any) -> list[dict[str, Any]]:
    """Content as a list of parts, as vLLM hands it to a template that loops over it: text
    parts keep their text, media parts become ``{"type": "image" | "audio" | "video"}``."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out: list[dict[str, Any]] = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image", "image_pil", "image_embeds"):
            out.append({"type": "image"})
        elif kind in ("input_audio", "audio_url", "audio"):
            out.append({"type": "audio"})
        elif kind in ("video_url", "video"):
            out.append({"type": "video"})
    return out


def chat_messages(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """The messages of a chat request, checked, as new dicts. Each content becomes one string
    (text parts joined by newlines, as vLLM passes them to a string-content template; None:
    empty), or with ``content_format="parts"`` a list of parts (``ChatTemplate.content_format``
    says which). Other fields of a message (``name``, ``tool_calls``, ``tool_call_id``) are
    kept, the arguments of an assistant's tool calls parsed from JSON.

    Raises InvalidArgumentError when ``messages`` is not a non-empty list, a message is not an
    object with a string ``role``, a content is neither a string, a list of objects nor null,
    or a tool call's arguments are not readable JSON."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidArgumentError(f"messages[{i}].content must be a string or a list of parts")
        if isinstance(content, list):
            bad = next((j for j, part in enumerate(content) if not isinstance(part, dict)), None)
            if bad is not None:  # vLLM refuses it too; dropping it would route another prompt
                raise InvalidArgumentError(
                    f"messages[{i}].content[{bad}] must be an object (a content part)"
                )
        shaped: Any
        if content_format == "parts":
            shaped = _parts(content)
        elif isinstance(content, list):  # content parts: the text parts count
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            shaped = "\n".join(t for t in texts if isinstance(t, str))
        else:
            shaped = content or ""
        flat = {**message, "content": shaped}
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list):
            flat["tool_calls"] = [_parsed_call(call, i) for call in calls]
        out.append(flat)
    return out


def _parsed_call(call: Any, i: int) -> Any:
    """A tool call with its JSON ``arguments`` string parsed (templates format the object), as
    vLLM hands tool calls to a template; none or empty arguments become ``{}``."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, dict | list):
        return call
    if not arguments:
        parsed: Any = {}
    else:
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise InvalidArgumentError(
                f"messages[{i}].tool_calls: function arguments are not valid JSON"
            ) from None
        except (ValueError, RecursionError) as exc:  # a number past 4,300 digits, deep nesting
            what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise InvalidArgumentError(
                f"messages[{i}].tool_calls: function arguments cannot be read: {what}"
            ) from None
    return {**call, "function": {**call["function"], "arguments": parsed}}
