"""Chat and text completion chunks over SSE, in the OpenAI order.

(chat: role chunk →) one chunk per denoising step that made text final → finish chunk →
optional usage chunk (``stream_options.include_usage``) → ``[DONE]``. With
``stream_options.continuous_usage_stats`` (vLLM) every chunk also carries the usage so far.
A failure after the 200 has been sent becomes one ``{"error": ...}`` event followed by
``[DONE]``, which the openai SDK raises as ``APIError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from dllm_serve.engine.outputs import RequestOutput


def usage_dict(output: RequestOutput, canvas_length: int) -> dict[str, Any]:
    return _usage(
        output.prompt_tokens,
        output.completion_tokens,
        canvas_length,
        output.nfe,
        output.committed,
        _speculation(output),
        output.cached_tokens,
    )


def _usage(
    prompt: int,
    completion: int,
    canvas_length: int,
    nfe: int = 0,
    committed: int = 0,
    speculation: dict[str, Any] | None = None,
    cached: int = 0,
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # As OpenAI reports it: prompt tokens whose K/V came from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": cached},
        "diffusion": {
            "nfe": nfe,
            "canvas_length": canvas_length,
            "committed_tokens": committed,
            "tokens_per_forward": round(committed / nfe, 4) if nfe else 0.0,
            **(speculation or {}),
        },
    }


_NO_DRAFTS = {"drafted_tokens": 0, "accepted_drafts": 0, "acceptance_rate": 0.0}


def _speculation(output: RequestOutput) -> dict[str, Any]:
    """Self-speculation counters (ISD, LinearSpec, and ar as ISD at stride 1: zero drafts);
    absent for diffusion decoding."""
    if output.drafted is None:
        return {}
    drafted, accepted = output.drafted, output.accepted_drafts or 0
    return {
        "drafted_tokens": drafted,
        "accepted_drafts": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
    }


def failure(output: RequestOutput) -> tuple[int, str, str, str | None]:
    """(HTTP status, message, error type, code) for a request that ended without an answer."""
    if output.finish_reason == "abort":
        detail = f": {output.error}" if output.error else "."
        return (
            503,
            f"The request was aborted by the server{detail}",
            "service_unavailable_error",
            ("request_aborted"),
        )
    if output.finish_reason == "timeout":
        return (
            504,
            "The request exceeded the server's time limit.",
            "server_error",
            ("request_timeout"),
        )
    return 500, f"The request failed in the engine: {output.error}", "server_error", None


def chat_chunks(
    outputs: AsyncGenerator[RequestOutput, None],
    *,
    response_id: str,
    created: int,
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool = False,
    prompt_tokens: int = 0,
    speculative: bool = False,
) -> AsyncGenerator[str, None]:
    """``chat.completion.chunk`` events: the text is in ``choices[0].delta.content``."""
    return _chunks(
        outputs,
        head={"id": response_id, "object": "chat.completion.chunk", "created": created},
        model=model,
        canvas_length=canvas_length,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        prompt_tokens=prompt_tokens,
        speculative=speculative,
        choice=lambda text, finish: {
            "index": 0,
            "delta": {} if finish else {"content": text},
            "logprobs": None,
            "finish_reason": finish,
        },
        first={"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None},
    )


def text_chunks(
    outputs: AsyncGenerator[RequestOutput, None],
    *,
    response_id: str,
    created: int,
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool = False,
    prompt_tokens: int = 0,
    speculative: bool = False,
) -> AsyncGenerator[str, None]:
    """``text_completion`` events (/v1/completions): the text is in ``choices[0].text``."""
    return _chunks(
        outputs,
        head={"id": response_id, "object": "text_completion", "created": created},
        model=model,
        canvas_length=canvas_length,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        prompt_tokens=prompt_tokens,
        speculative=speculative,
        choice=lambda text, finish: {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
        },
        first=None,
    )


async def _chunks(
    outputs: AsyncGenerator[RequestOutput, None],
    *,
    head: dict[str, Any],
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool,
    prompt_tokens: int,
    choice: Callable[[str, str | None], dict[str, Any]],
    first: dict[str, Any] | None,
    speculative: bool = False,
) -> AsyncGenerator[str, None]:
    # Before the first step (the role chunk): nothing generated yet, but the same shape as
    # every later chunk's usage, so a client can read ``usage.diffusion`` on any chunk (a
    # self-speculative request's draft counters included).
    drafts = _NO_DRAFTS if speculative else None
    usage: dict[str, Any] | None = _usage(prompt_tokens, 0, canvas_length, speculation=drafts)

    def chunk(choice_body: dict[str, Any]) -> str:
        body: dict[str, Any] = {**head, "model": model, "choices": [choice_body]}
        if continuous_usage:
            body["usage"] = usage
        elif include_usage:
            body["usage"] = None
        return json.dumps(body, ensure_ascii=False)

    # Closed with this generator: a client that went away aborts its request now, not
    # when the garbage collector finalises the engine's iterator.
    async with contextlib.aclosing(outputs):
        if first is not None:
            if first.get("finish_reason", None) is None:
                first = {**first, "finish_reason": None}
            yield chunk(first)
        async for output in outputs:
            usage = usage_dict(output, canvas_length)  # cumulative: everything so far
            if output.delta_text:
                yield chunk(choice(output.delta_text, None))
            if not output.finished:
                continue
            if output.finish_reason in ("stop", "length"):
                yield chunk(choice("", output.finish_reason))
                if include_usage:
                    final = {**head, "model": model, "choices": [], "usage": usage}
                    yield json.dumps(final, ensure_ascii=False)
            else:
                _, message, kind, code = failure(output)
                error = {"message": message, "type": kind, "param": None, "code": code}
                yield json.dumps({"error": error}, ensure_ascii=False)
    yield "[DONE]"
