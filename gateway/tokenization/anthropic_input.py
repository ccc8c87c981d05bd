"""An Anthropic Messages API request as the chat messages vLLM renders.

vLLM's ``/v1/messages`` (``AnthropicServingMessages``) converts the request to a chat completion
and renders that with the chat template: ``system`` (a string, or the concatenated text of its
blocks) becomes a leading system message; a message's text blocks become its content (a lone
text block as a string); ``tool_use`` blocks become ``tool_calls`` (arguments JSON-encoded);
a user's ``tool_result`` blocks become tool messages placed before that user message, which is
dropped when nothing else is left in it; ``thinking`` blocks become the assistant's
``reasoning``; tools become chat tools. The gateway must produce the same messages so its
routing keys are the engine's tokens.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tokenization.types import TokenizationError

__all__ = ["anthropic_messages", "anthropic_tools"]

_ROLES = ("user", "assistant")


def anthropic_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """The chat messages of a Messages request (raises ``TokenizationError``)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _system_text(system)})
    if not isinstance(messages, list) or not messages:
        raise TokenizationError("messages must contain at least one item")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise TokenizationError(f"{where} must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role not in _ROLES:
            raise TokenizationError(f"{where}.role must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise TokenizationError(f"{where}.content must be a string or a non-empty list")
        message = _blocks_message(role, content, out, where)
        if message is not None:
            out.append(message)
    return out


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise TokenizationError("system must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict):
            raise TokenizationError(f"system[{i}] must be an object")
        if block.get("type") == "text" and block.get("text"):
            texts.append(_str(block, "text", f"system[{i}]"))
    return "".join(texts)


def _blocks_message(
    role: str, blocks: list[Any], out: list[dict[str, Any]], where: str
) -> dict[str, Any] | None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise TokenizationError(f"{at} must be an object")
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": _str(block, "text", at)})
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(_str(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name = block.get("name") or ""
            tool_input = block.get("input") or {}
            if not isinstance(name, str) or not isinstance(tool_input, dict):
                raise TokenizationError(f"{at}: name must be a string and input an object")
            call_id = block.get("id")
            if not isinstance(call_id, str) or not call_id:
                raise TokenizationError(f"{at}.id must be a non-empty string")
            arguments = json.dumps(tool_input)
            tool_calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            text = _result_text(block.get("content"))
            if role == "user":
                call_id = block.get("id") or ""  # vLLM reads ``id``, not ``tool_use_id``
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
        else:
            raise TokenizationError(f"{at}.type {kind!r} is not supported by this gateway")
    message: dict[str, Any] = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    if parts:
        message["content"] = parts[0]["text"] if len(parts) == 1 else parts
    elif not tool_calls and not reasoning:
        return None
    return message


def _result_text(content: Any) -> str:
    """vLLM's ``str(block.content) if block.content else ""`` (a list shows as Python repr)."""
    return str(content) if content else ""


def _str(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise TokenizationError(f"{where}.{key} must be a string")
    return value


def anthropic_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools (``name``, ``description``, ``input_schema``) as chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizationError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise TokenizationError(f"tools[{i}] must be an object with a string name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise TokenizationError(f"tools[{i}].input_schema must be an object")
        if "type" not in schema:
            schema = {**schema, "type": "object"}  # vLLM's default
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": schema,
        }
        out.append({"type": "function", "function": function})
    return out
