"""Chat messages → plain ``{role, content}`` dicts for the chat template.

Accepts what the API itself returns (an assistant message with ``refusal``/``annotations``…
``null``), ``developer`` as ``system`` and text-part lists; anything else is a 400 naming the
message field.
"""

from __future__ import annotations

from typing import Any

from dllm_serve.api.errors import invalid
from dllm_serve.api.protocol import ChatCompletionRequest, ChatMessage


def messages_of(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(req.messages):
        _check_returned_fields(m, i)
        # "developer" is OpenAI's current name for the system role.
        role = "system" if m.role == "developer" else m.role
        message = {"role": role, "content": _content_text(m.content, f"messages[{i}].content")}
        if m.name is not None:
            message["name"] = m.name  # chat templates that have a slot for it use it
        out.append(message)
    return out


def _check_returned_fields(m: ChatMessage, i: int) -> None:
    """Fields of the assistant message this server returns: only their empty values."""
    for name in ("tool_calls", "function_call"):
        value = getattr(m, name)
        if value is not None and not (name == "tool_calls" and value == []):
            raise invalid(
                f"'messages[{i}].{name}' is not supported by diffusion decoding: function "
                f"calling is out of scope. Only null{' or []' if name == 'tool_calls' else ''} "
                "is accepted.",
                f"messages[{i}].{name}",
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
