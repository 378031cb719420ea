"""Tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``): the request's tools for
the model's own chat template, the messages of a tool round trip, and the parser that turns
a finished answer into ``tool_calls``.

The server renders the tools with the model's chat template, as vLLM does, so the model sees
them in the format it was trained on; a template that does not render them (the output would
not change) is a 400 rather than tools silently ignored. The answer is parsed by the parser of
the template's format:

- ``hermes`` (Qwen2.5/Qwen3 templates: Dream, SDAR/TraDo, I-DLM, Fast-dLLM v2): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text outside the calls is
  the message content.

A diffusion answer is only known to hold a call once it is whole, so with tools the answer
comes as one piece at its end (streamed: one content or tool-call chunk, then the finish).

``tool_choice: "required"`` and a named function are enforced with the structured-output
grammar (decoding/grammar.py), as vLLM does: a named function's answer is its arguments, a
JSON value of its ``parameters`` schema; ``required``'s is ``{"name": ..., "arguments": ...}``
for one of the tools. Either answer becomes one tool call. ``auto`` in the hermes format is
decoded under "text without a ``<tool_call>`` marker, or text then valid calls" wherever the
request's decoding enforces grammars (api/pipeline.py), so a call the parser reads is never
broken; elsewhere the answer is parsed as it comes.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from dllm_serve.api.errors import invalid
from dllm_serve.decoding.grammar import tool_call_grammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A request's tools: as the chat template takes them, the choice, whether several calls
    may come back, and the parser of the model's format (set once the template is known)."""

    tools: list[dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "named"
    parallel: bool = True
    parser: str | None = None
    function: str | None = None  # the named function

    @property
    def parse(self) -> bool:
        """Whether the answer is parsed for calls in the model's format (``auto``)."""
        return self.choice == "auto"

    @property
    def forced(self) -> bool:
        """Whether the answer is a call constrained by the grammar (``required``, named)."""
        return self.choice in ("required", "named")

    def _parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object"}

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call: ``{"name", "arguments"}`` for one of the tools."""
        return {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name},
                                              "arguments": self._parameters(name)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name in (t["function"]["name"] for t in self.tools)
        ]}  # fmt: skip

    def response_format(self) -> dict[str, Any]:
        """The structured-output format a forced call is decoded under."""
        if self.choice == "named":
            assert self.function is not None
            schema = self._parameters(self.function)
        else:
            schema = self.call_schema()
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def auto_grammar(self, markers: tuple[int, int] | None) -> str:
        """The grammar an ``auto`` answer in the hermes format is decoded under: text, or
        text then valid calls (:func:`~dllm_serve.decoding.grammar.tool_call_grammar`)."""
        return tool_call_grammar(self.call_schema(), self.parallel, markers)


def tool_spec(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolSpec | None:
    """The validated tools of a request (None without any); a 400 for a malformed tool or a
    choice this server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list of function tools.", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        names.append(_check_tool(tool, f"tools[{i}]"))
    if len(set(names)) != len(names):
        raise invalid("Each tool's 'function.name' must be unique.", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise invalid(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": <one of the tools>}}.',
                "tool_choice",
            )
        return ToolSpec(tools, "named", parallel_tool_calls is not False, function=name)
    if choice not in ("none", "auto", "required"):
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or a named function.", "tool_choice"
        )
    return ToolSpec(tools, choice, parallel_tool_calls is not False)


def _check_tool(tool: Any, param: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f'\'{param}\' must be a function tool: {{"type": "function", ...}}.', param)
    if set(tool) - {"type", "function"}:
        raise invalid(
            f"'{param}' has unknown keys {sorted(set(tool) - {'type', 'function'})}.", param
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"'{param}.function' must be an object.", f"{param}.function")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        where = f"{param}.function"
        raise invalid(f"'{where}' has unknown keys {sorted(unknown)}.", where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(
            f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'.",
            f"{param}.function.name",
        )
    parameters = function.get("parameters")
    is_object = isinstance(parameters, dict) and parameters.get("type", "object") == "object"
    if parameters is not None and not is_object:
        raise invalid(
            f"'{param}.function.parameters' must be a JSON schema of an object.",
            f"{param}.function.parameters",
        )
    return name


# ---- messages of a tool round trip -------------------------------------------------------------


def assistant_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the chat template takes them (arguments as an
    object, the way the templates render them with ``tojson``)."""
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a list of tool calls.", param)
    calls = []
    for j, call in enumerate(value):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments", ""), str)
        ):
            raise invalid(
                f'\'{where}\' must be {{"id", "type": "function", "function": '
                '{"name": str, "arguments": str}}.',
                where,
            )
        arguments: Any = function.get("arguments") or "{}"
        with contextlib.suppress(json.JSONDecodeError):  # else the template renders the string
            arguments = json.loads(arguments)
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


# ---- the answer's calls ------------------------------------------------------------------------


def parser_for(template: str | None) -> str | None:
    """The tool-call format of a chat template (None: no parser knows it)."""
    if template and "<tool_call>" in template:
        return "hermes"
    return None


def parse_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished answer: the calls in the parser's format (at most
    one without ``parallel_tool_calls``), the rest as content (None when nothing is left). A
    block that is not a valid call stays in the content."""
    if spec.forced:
        return _forced_call(text, spec)
    if not spec.parse or spec.parser != "hermes":
        return text, []
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    end = 0
    for match in HERMES_CALL.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None or (calls and not spec.parallel):
            continue  # an invalid block stays text; extra calls beyond one are dropped
        kept.append(text[end : match.start()])
        end = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None), calls


def _forced_call(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """The one call of a forced answer: the grammar made it JSON of the right shape. Cut by
    ``max_tokens`` first, a named call keeps its arguments as decoded so far (as OpenAI
    returns a cut call, with ``finish_reason`` length); a ``required`` answer that does not
    name its function yet stays text."""
    if spec.choice == "named":
        assert spec.function is not None
        return None, [_call(spec.function, text)]
    try:
        value = json.loads(text)
        return None, [_call(value["name"], json.dumps(value["arguments"], ensure_ascii=False))]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"], json.dumps(arguments, ensure_ascii=False))
