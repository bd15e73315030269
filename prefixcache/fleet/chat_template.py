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

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, InvalidArgumentError

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str = "<template>"):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError(
                f"{name}: chat templates need jinja2 (pip install 'prefixcache[service]')"
            ) from None

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{name}: chat template line {exc.lineno}: {exc.message}") from None
        self.name = name
        self.special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, path: str | Path) -> ChatTemplate:
        """From a ``.jinja`` file, or the ``chat_template`` of a JSON tokenizer config (its
        default one where it lists several)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read chat template {path}: {exc}") from None
        if path.suffix != ".json":
            return cls(text, {}, path.name)
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ConfigError(f"{path}: no 'chat_template' string (or list with a 'default')")
        special = {}
        for key in _SPECIAL:
            value = config.get(key)
            if isinstance(value, dict):  # an added token: {"content": ..., ...}
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source, special, path.name)

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
        """The prompt text of a conversation. ``continue_final_message`` ends the text right
        after the last message's content (stripped; no end-of-turn marker), so the model
        continues it.
        InvalidArgumentError when the template refuses the conversation (a
        ``raise_exception``) or fails on it."""
        import jinja2

        if add_generation_prompt and continue_final_message:
            raise InvalidArgumentError(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        context = {**self.special_tokens, **(extra or {})}
        context.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if tools is not None:
            context["tools"] = tools
        if documents is not None:
            context["documents"] = documents
        try:
            text = self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"chat template {self.name}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"chat template {self.name} failed on these messages: {exc}"
            ) from None
        if continue_final_message:  # cut after the last message's (stripped) content
            final = messages[-1].get("content") if messages else None
            final = final.strip() if isinstance(final, str) else ""
            if not final or final not in text:
                raise InvalidArgumentError(
                    "continue_final_message: the final message's content is not in the prompt"
                )
            text = text[: text.rindex(final) + len(final)].rstrip()
        return text


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages of a chat request, checked, with each content as one string (text parts
    joined by newlines, as vLLM passes them to a string-content template); other fields of a
    message (``name``, ``tool_calls``, ``tool_call_id``) are kept."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text parts count
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "\n".join(t for t in texts if isinstance(t, str))
        elif content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidArgumentError(f"messages[{i}].content must be a string or a list of parts")
        out.append({**message, "content": content})
    return out
