"""Chat messages → the plain ``{role, content}`` dicts the chat template takes. What the API
itself returns (an assistant message with ``refusal``/``annotations``… ``null``), ``developer``
as ``system``, text-part lists and tool calls with their answers are accepted; anything else
is a 400 naming the message field.
"""

from __future__ import annotations

from typing import Any

from dllm_serve.api.errors import invalid
from dllm_serve.api.protocol import ChatCompletionRequest, ChatMessage
from dllm_serve.api.tools import assistant_tool_calls


def messages_of(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content, the assistant's tool
    calls (arguments as objects) and the tool messages that answer them."""
    if not req.messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(req.messages):
        _check_returned_fields(m, i)
        # "developer" is OpenAI's current name for the system role.
        role = "system" if m.role == "developer" else m.role
        calls = assistant_tool_calls(m.tool_calls, f"messages[{i}].tool_calls") if (
            m.tool_calls
        ) else None  # fmt: skip
        if m.tool_calls and role != "assistant":
            raise invalid("Only assistant messages carry 'tool_calls'.",
                          f"messages[{i}].tool_calls")  # fmt: skip
        if role == "tool" and not m.tool_call_id:
            raise invalid("A tool message needs 'tool_call_id' (the call it answers).",
                          f"messages[{i}].tool_call_id")  # fmt: skip
        if m.tool_call_id is not None and role != "tool":
            raise invalid("Only tool messages carry 'tool_call_id'.", f"messages[{i}].tool_call_id")
        # An assistant message that only calls tools has no content (null).
        content = "" if calls and m.content is None else m.content
        message: dict[str, Any] = {
            "role": role, "content": _content_text(content, f"messages[{i}].content"),
        }  # fmt: skip
        if calls:
            message["tool_calls"] = calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name  # chat templates that have a slot for it use it
        out.append(message)
    return out


def _check_returned_fields(m: ChatMessage, i: int) -> None:
    """Fields of the assistant message this server returns: only their empty values (tool
    calls are checked by :func:`messages_of`)."""
    if m.function_call is not None:
        raise invalid(
            f"'messages[{i}].function_call' is not supported: the legacy functions API is "
            "not (use 'tool_calls'). Only null is accepted.",
            f"messages[{i}].function_call",
            code="unsupported_parameter",
        )
    for name, empty in (("refusal", "null"), ("audio", "null"), ("annotations", "null or []")):
        value = getattr(m, name)
        if value is not None and not (name == "annotations" and value == []):
            raise invalid(
                f"'messages[{i}].{name}' must be {empty}: this server never returns one.",
                f"messages[{i}].{name}",
            )


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(
                    f"Invalid content part at '{param}[{j}]': only text parts "
                    '({"type": "text", "text": "..."}) are supported.',
                    f"{param}[{j}]",
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise invalid(
                    f"Invalid content part at '{param}[{j}]': a text part has exactly the "
                    "keys 'type' and 'text', and 'text' is a string.",
                    f"{param}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(
        f"Invalid value for '{param}': content must be a string or a list of text parts.", param
    )
