"""Messages and tools checked and converted the way vLLM's ``chat_utils`` converts them.

Text parts are joined with ``"\\n"``, a null content becomes ``""``, tool-call ``arguments``
are parsed from JSON into a dict, unknown message keys are dropped; templates that loop over a
message's content get it as a list of text parts (vLLM's "openai" content format).
``normalize_messages`` is the optional whitespace normalisation a pool may turn on."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.tokenization.types import ContentFormat, TokenizationError

STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Unknown roles pass to the template (vLLM accepts custom roles) but must look like a role.
_CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
# Content part types carrying text, and the key the text is under (vLLM's MM_PARSER_MAP).
_TEXT_PART_KEYS: Mapping[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def _normalize_text(text: str) -> str:
    return text.replace("\r\n", "\n").rstrip()


def normalize_messages(messages: Any) -> Any:
    """Copies of ``messages`` with ``\\r\\n`` turned into ``\\n`` and trailing whitespace removed
    from every text content. With ``normalize=True`` the gateway must forward these messages
    upstream (not the originals), or the engine would see different tokens than were routed.
    Anything that is not a well-formed message is left as it is for validation to reject."""
    if not isinstance(messages, list):
        return messages
    return [_normalize_message(m) for m in messages]


def _normalize_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": _normalize_text(content)}
    if isinstance(content, list):
        return {**message, "content": [_normalize_part(p) for p in content]}
    return dict(message)


def _normalize_part(part: Any) -> Any:
    if isinstance(part, str):
        return _normalize_text(part)
    if isinstance(part, dict):
        key = _TEXT_PART_KEYS.get(part.get("type", ""))
        if key is not None and isinstance(part.get(key), str):
            return {**part, key: _normalize_text(part[key])}
    return part


def prepare_messages(
    messages: Any, content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and convert them as vLLM does before rendering.

    Raises :class:`TokenizationError` naming the first problem. Roles: the standard five, or a
    custom role name (passed to the template as vLLM does; ``[A-Za-z][A-Za-z0-9_.-]{0,63}``).
    """
    if not isinstance(messages, list) or not messages:
        raise TokenizationError("messages must be a non-empty list")
    wrap = content_format == "openai"
    out = []
    for i, m in enumerate(messages):
        # The common message, ``{"role": <standard role>, "content": <text>}`` and nothing
        # else, converted inline: what the general path below makes of it, at a fraction of
        # its cost (a long chat is hundreds of these on every turn).
        if type(m) is dict and len(m) == 2:
            role, content = m.get("role"), m.get("content")
            if type(content) is str and type(role) is str and role in STANDARD_ROLES:
                if wrap and role != "tool":
                    content = [{"type": "text", "text": content}]
                out.append({"role": role, "content": content})
                continue
        out.append(_prepare_message(m, i, content_format))
    return out


def _prepare_message(message: Any, index: int, fmt: ContentFormat) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise TokenizationError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not (role in STANDARD_ROLES or _CUSTOM_ROLE.fullmatch(role)):
        raise TokenizationError(f"{where}.role must be a role name, got {role!r}")
    out: dict[str, Any] = {"role": role}
    out["content"] = _prepare_content(message, role, where, fmt)
    if role == "assistant":
        _prepare_assistant_fields(message, out, where)
    elif role == "tool" and "tool_call_id" in message:
        if not isinstance(message["tool_call_id"], str):
            raise TokenizationError(f"{where}.tool_call_id must be a string")
        out["tool_call_id"] = message["tool_call_id"]
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise TokenizationError(f"{where}.name must be a string")
        out["name"] = name
    return out


def _prepare_content(message: dict[str, Any], role: str, where: str, fmt: ContentFormat) -> Any:
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise TokenizationError(f"{where}.content is required for role {role!r}")
        return [] if fmt == "openai" else ""
    if isinstance(content, str):
        wrap = fmt == "openai" and role != "tool"  # vLLM hands tool results over as text
        return [{"type": "text", "text": content}] if wrap else content
    if not isinstance(content, list):
        raise TokenizationError(
            f"{where}.content must be a string, null or a list of content parts, "
            f"got {type(content).__name__}"
        )
    texts = [_part_text(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    if fmt == "openai" and role != "tool":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise TokenizationError(f"{where} must be an object")
    kind = part.get("type")
    key = _TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise TokenizationError(
            f"{where}.type {kind!r} is not supported: this model takes text parts only"
        )
    text = part.get(key)
    if not isinstance(text, str):
        raise TokenizationError(f"{where}.{key} must be a string")
    return text


def _prepare_assistant_fields(message: dict[str, Any], out: dict[str, Any], where: str) -> None:
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise TokenizationError(f"{where}.tool_calls must be a list")
        if tool_calls:  # vLLM drops an empty list so templates take the plain assistant path
            out["tool_calls"] = [
                _prepare_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(tool_calls)
            ]
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise TokenizationError(f"{where}.{key} must be a string")
        out["reasoning"] = out["reasoning_content"] = value


def _prepare_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise TokenizationError(f"{where} must be an object")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TokenizationError(f"{where}.function must be an object with a string name")
    kind = call.get("type", "function")
    if not isinstance(kind, str):
        raise TokenizationError(f"{where}.type must be a string")
    out: dict[str, Any] = {}
    if "id" in call:
        if not isinstance(call["id"], str):
            raise TokenizationError(f"{where}.id must be a string")
        out["id"] = call["id"]
    out["type"] = kind
    out["function"] = {"name": function["name"], "arguments": _tool_arguments(function)}
    return out


def _tool_arguments(function: dict[str, Any]) -> Any:
    """vLLM parses JSON-string arguments into a dict; anything unparsable becomes ``{}``."""
    args = function.get("arguments")
    if isinstance(args, dict | list):
        return args
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return {}
    return {}


def prepare_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Validate tool definitions and shape them as vLLM dumps its pydantic models: ``type``, then ``function`` with
    ``name``, ``description`` and ``parameters`` first (null when absent), extra keys after."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizationError("tools must be a list")
    return [_prepare_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]


def _prepare_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise TokenizationError(f"{where} must be an object")
    if tool.get("type", "function") != "function":
        raise TokenizationError(f"{where}.type must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TokenizationError(f"{where}.function must be an object with a string name")
    description, parameters = function.get("description"), function.get("parameters")
    if description is not None and not isinstance(description, str):
        raise TokenizationError(f"{where}.function.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise TokenizationError(f"{where}.function.parameters must be an object")
    fields = {"name": function["name"], "description": description, "parameters": parameters}
    extra = {k: v for k, v in function.items() if k not in fields}
    rest = {k: v for k, v in tool.items() if k not in ("type", "function")}
    return {"type": "function", "function": {**fields, **extra}, **rest}
