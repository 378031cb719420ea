"""Chat and text completion chunks over SSE, in the OpenAI order, and the usage of one or
several choices.

(chat: role chunk →) one chunk per denoising step that made text final → finish chunk →
optional usage chunk (``stream_options.include_usage``) → ``[DONE]``. With ``n > 1`` each
choice's chunks carry its ``index`` and interleave as its steps finish; the usage chunk comes
after every choice's finish chunk. With ``stream_options.continuous_usage_stats`` (vLLM) every
chunk also carries the usage so far. A failure after the 200 has been sent becomes one
``{"error": ...}`` event followed by ``[DONE]``, which the openai SDK raises as ``APIError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from dllm_serve.api.tools import ToolSpec, parse_calls
from dllm_serve.engine.outputs import RequestOutput

Choices = AsyncGenerator[tuple[int, RequestOutput], None]


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


def choices_usage(outputs: Sequence[RequestOutput], canvas_length: int) -> dict[str, Any]:
    """The usage of a request's choices (their latest outputs): the prompt once, as OpenAI
    counts it, and everything generated summed over the choices."""
    if len(outputs) == 1:
        return usage_dict(outputs[0], canvas_length)
    drafted = [o.drafted for o in outputs if o.drafted is not None]
    speculation = None
    if drafted:
        accepted = sum(o.accepted_drafts or 0 for o in outputs)
        speculation = {
            "drafted_tokens": sum(drafted),
            "accepted_drafts": accepted,
            "acceptance_rate": round(accepted / sum(drafted), 4) if sum(drafted) else 0.0,
        }
    return _usage(
        outputs[0].prompt_tokens,
        sum(o.completion_tokens for o in outputs),
        canvas_length,
        sum(o.nfe for o in outputs),
        sum(o.committed for o in outputs),
        speculation,
        # The prompt is counted once: its tokens that came from the cache for every choice.
        min(o.cached_tokens for o in outputs),
    )


def chat_logprobs(entries: Sequence[Any] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` from the engine's entries (engine/logprobs.py)."""
    if entries is None:
        return None

    def one(text: str, logprob: float) -> dict[str, Any]:
        # JSON has no -inf: a token the model rules out reads -9999, as in vLLM.
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    content = [
        one(text, lp) | {"top_logprobs": [one(t, alt) for t, alt in alternatives]}
        for text, lp, alternatives in entries
    ]
    return {"content": content, "refusal": None}


def text_logprobs(entries: Sequence[Any] | None, offset: int = 0) -> dict[str, Any] | None:
    """A text completion choice's ``logprobs`` (the legacy shape); ``offset``: characters of
    the answer before these tokens."""
    if entries is None:
        return None
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [max(lp, -9999.0) for _, lp, _ in entries],
        "top_logprobs": [
            {t: max(alt, -9999.0) for t, alt in alternatives} for _, _, alternatives in entries
        ],
        "text_offset": offsets,
    }


async def merged(streams: Sequence[AsyncGenerator[RequestOutput, None]]) -> Choices:
    """Every choice's outputs as ``(index, output)``, in the order they arrive. Closing this
    generator closes every stream (aborting the choices still running)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for output in only:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    queue.put_nowait((index, output))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    outputs: Choices,
    *,
    response_id: str,
    created: int,
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool = False,
    prompt_tokens: int = 0,
    speculative: bool = False,
    n: int = 1,
    tools: ToolSpec | None = None,
) -> AsyncGenerator[str, None]:
    """``chat.completion.chunk`` events: the text is in ``choices[0].delta.content``; with
    ``tools`` parsed (``tool_choice`` auto) each choice's answer is held to its end and comes
    as one content chunk and/or one ``delta.tool_calls`` chunk (api/tools.py)."""
    return _chunks(
        outputs,
        head={"id": response_id, "object": "chat.completion.chunk", "created": created},
        model=model,
        canvas_length=canvas_length,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        prompt_tokens=prompt_tokens,
        speculative=speculative,
        n=n,
        choice=lambda text, finish, index, entries: {
            "index": index,
            "delta": {} if finish else {"content": text},
            "logprobs": chat_logprobs(entries),
            "finish_reason": finish,
        },
        first=lambda index: {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        },
        tools=tools if tools is not None and (tools.parse or tools.forced) else None,
    )


def text_chunks(
    outputs: Choices,
    *,
    response_id: str,
    created: int,
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool = False,
    prompt_tokens: int = 0,
    speculative: bool = False,
    n: int = 1,
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
        n=n,
        choice=lambda text, finish, index, entries: {
            "index": index,
            "text": text,
            "logprobs": text_logprobs(entries),
            "finish_reason": finish,
        },
        first=None,
    )


async def _chunks(
    outputs: Choices,
    *,
    head: dict[str, Any],
    model: str,
    canvas_length: int,
    include_usage: bool,
    continuous_usage: bool,
    prompt_tokens: int,
    choice: Callable[[str, str | None, int, Sequence[Any] | None], dict[str, Any]],
    first: Callable[[int], dict[str, Any]] | None,
    speculative: bool = False,
    n: int = 1,
    tools: ToolSpec | None = None,
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

    latest: dict[int, RequestOutput] = {}  # each choice's last output: the usage so far
    finished = 0
    held: dict[int, tuple[list[str], list]] = {}  # with tools: each choice's text and entries
    # Closed with this generator: a client that went away aborts its requests now, not
    # when the garbage collector finalises the engine's iterators.
    async with contextlib.aclosing(outputs):
        if first is not None:
            for index in range(n):
                yield chunk(first(index))
        async for index, output in outputs:
            latest[index] = output
            usage = choices_usage(list(latest.values()), canvas_length)  # cumulative
            if tools is not None:
                parts, entries = held.setdefault(index, ([], []))
                parts.append(output.delta_text)
                entries.extend(output.logprobs or ())
            elif output.delta_text or output.logprobs:
                yield chunk(choice(output.delta_text, None, index, output.logprobs))
            if not output.finished:
                continue
            if output.finish_reason not in ("stop", "length"):
                _, message, kind, code = failure(output)
                error = {"message": message, "type": kind, "param": None, "code": code}
                yield json.dumps({"error": error}, ensure_ascii=False)
                break  # the other choices are aborted as the stream closes
            reason = output.finish_reason
            if tools is not None:
                parts, entries = held.pop(index, ([], []))
                content, calls = parse_calls("".join(parts), tools)
                logprobs = entries if output.logprobs is not None or entries else None
                if content:
                    yield chunk(choice(content, None, index, logprobs))
                if calls:
                    deltas = [{"index": j, **call} for j, call in enumerate(calls)]
                    yield chunk({"index": index, "delta": {"tool_calls": deltas},
                                 "logprobs": None, "finish_reason": None})  # fmt: skip
                    reason = "tool_calls" if reason == "stop" else reason
            yield chunk(choice("", reason, index, None))
            finished += 1
            if finished == n and include_usage:
                final = {**head, "model": model, "choices": [], "usage": usage}
                yield json.dumps(final, ensure_ascii=False)
    yield "[DONE]"
