"""The OpenAI Responses API's ``instructions`` + ``input`` as the chat messages vLLM renders.

vLLM's ``/v1/responses`` (``construct_input_messages``) turns the request into chat messages and
applies the chat template to them: ``instructions`` become a leading system message, a string
``input`` one user message; input items map one to one (messages pass through, ``function_call``
items become the previous assistant message's ``tool_calls``, ``function_call_output`` a tool
message, ``reasoning`` the assistant's ``reasoning``). Flat Responses tools become chat tools.
The gateway must produce the same messages so its routing keys are the engine's tokens.

Stored-state inputs (``previous_response_id``, ``conversation``) are refused: they name a
response held by one engine (vLLM keeps them only with ``VLLM_ENABLE_RESPONSES_API_STORE``),
so the gateway could neither know the prompt nor find the engine that holds it.
"""

from __future__ import annotations

from typing import Any

from gateway.tokenization.types import TokenizationError

__all__ = ["responses_messages", "responses_tools"]


def responses_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (raises ``TokenizationError``)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None and not isinstance(instructions, str):
        raise TokenizationError("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list) or not items:
        raise TokenizationError("input must be a string or a non-empty list of input items")
    for i, item in enumerate(items):
        message = _item_message(item, messages[-1] if messages else None, f"input[{i}]")
        if message is not None:
            messages.append(message)
    return messages


def _item_message(item: Any, prev: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """One input item as a new message, or None when it was merged into ``prev``."""
    if not isinstance(item, dict):
        raise TokenizationError(f"{where} must be an object")
    kind = item.get("type", "message")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        call = _tool_call(item, where)
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        output, call_id = item.get("output"), item.get("call_id")
        if not isinstance(output, str) or not isinstance(call_id, str):
            raise TokenizationError(f"{where}: output and call_id must be strings")
        return {"role": "tool", "content": output, "tool_call_id": call_id}
    if kind == "reasoning":
        text = _reasoning_text(item, where)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind != "message":
        raise TokenizationError(f"{where}.type {kind!r} is not supported by this gateway")
    if item.get("role") == "assistant":
        text = _assistant_text(item.get("content"), where)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    return item  # user, system, developer: passed to the chat pipeline as they are


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
        raise TokenizationError(f"{where}: name, arguments and call_id must be strings")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = f"{namespace}.{name}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    if item.get("encrypted_content"):
        raise TokenizationError(f"{where}: encrypted reasoning content is not supported")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            text = parts[0].get("text") if isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise TokenizationError(f"{where}.{key}[0].text must be a string")
            return text
    return ""


def _assistant_text(content: Any, where: str) -> str:
    """vLLM keeps the first part's text of an assistant message."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        if isinstance(text, str):
            return text
    raise TokenizationError(f"{where}.content must be a string or a list of output_text parts")


def responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools (``{"type": "function", "function": ...}``)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizationError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise TokenizationError(
                f"tools[{i}].type {kind!r} is not supported by this gateway (function tools only)"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out or None
