"""Request bodies of the service's JSON API, decoded strictly with msgspec.

Token ids must be JSON integers in [0, 2**31) (no bools, no floats); unknown fields are
rejected; every error names the field (``$.tokens[3]``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.tokens import MAX_TOKEN_ID
from prefixcache.errors import InvalidRequestBodyError, MalformedJSONError
from prefixcache.fleet.router import MAX_REQUEST_ID_CHARS

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]


class PromptBody(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt (token ids, text, or chat messages rendered with the chat template) and the
    namespace it belongs to."""

    model: str
    tokens: list[TokenId] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    adapter: str | None = None
    adapter_version: str | None = None
    salt: str | None = None
    extra: list[str] = msgspec.field(default_factory=list)
    # a text's special tokens, as the engine's text completion takes it (None: added)
    add_special_tokens: bool | None = None

    def namespace(self) -> Namespace:
        """The namespace the body names."""
        return Namespace(
            self.model, self.adapter, self.adapter_version, self.salt, tuple(self.extra)
        )


class RouteBody(PromptBody, forbid_unknown_fields=True):
    """A prompt to route; with a ``request_id`` the route counts as load until released."""

    request_id: RequestId | None = None


class ReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    """The request whose load ends, and what its engine reported serving from its cache
    (``usage.prompt_tokens_details.cached_tokens``), when the gateway has it."""

    request_id: RequestId
    cached_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


Body = TypeVar("Body")


def decode_body(raw: bytes, kind: type[Body]) -> Body:
    """``raw`` decoded as ``kind`` (a body struct, or ``dict`` for a body passed on);
    MalformedJSONError when it is not JSON, InvalidRequestBodyError saying what and where when
    it is not that JSON."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestBodyError(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedJSONError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise MalformedJSONError("request body is nested too deeply") from None
