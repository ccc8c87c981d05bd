"""Chat templates rendered as transformers' ``apply_chat_template`` renders them.

A jinja2 sandbox built like transformers' (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, loop controls, the ``{% generation %}`` tag, its ``tojson``,
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``); vLLM's detection of a
template's content format from its source; and where templates come from (bundled names,
``.jinja`` paths, a model directory's ``tokenizer_config.json`` or ``chat_template.jinja``)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tokenization.types import ContentFormat, TokenizationError

TEMPLATES_DIR = Path(__file__).parent.parent / "templates"
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


RENDER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Names under which a message's reasoning is passed; transformers copies the first one found to
# ``thinking`` and ``reasoning_content``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REASONING_KEYS = frozenset(_REASONING_FIELDS)


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


def compile_template(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizationError(f"chat template {origin} does not compile: {e}") from e


def alias_reasoning_fields(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers copies a message's reasoning to ``thinking`` and ``reasoning_content``."""
    out = []
    for message in messages:
        if _REASONING_KEYS.isdisjoint(message):  # the common case: nothing to copy
            out.append(message)
            continue
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


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


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def bundled_templates() -> list[str]:
    """Names of the chat templates shipped in ``gateway/templates``."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def model_templates(directory: Path | None) -> dict[str, str]:
    """The model's own templates, as transformers finds them: chat_template.jinja first, then
    tokenizer_config.json's ``chat_template`` (a string or a list of named templates)."""
    if directory is None:
        return {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    value = read_json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
    return {}


def named_template(spec: str | Path) -> tuple[str, str]:
    """(source, origin) of a template given by bundled name, file path or literal text."""
    if isinstance(spec, str):
        if "{{" in spec or "{%" in spec:  # before any file lookup: a long one is no file name
            return spec, "literal"
        name = TEMPLATE_ALIASES.get(spec, spec)
        bundled = TEMPLATES_DIR / f"{name}.jinja"
        if "/" not in name and bundled.is_file():
            return bundled.read_text(encoding="utf-8"), f"bundled:{name}"
    path = Path(spec)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    raise FileNotFoundError(
        f"chat template {str(spec)!r} is neither a bundled template "
        f"({', '.join(bundled_templates())}) nor a file"
    )
