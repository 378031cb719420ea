"""Offline API: the same engine as the server, without HTTP, for scripts and benchmarks.

from dllm_serve import LLM
with LLM("demo-llada") as llm:
    [out] = llm.chat([[{"role": "user", "content": "What is 2 + 2?"}]], max_tokens=64)
    print(out.text, out.finish_reason, out.nfe)          # 2 + 2 = 4 stop ...

:meth:`LLM.chat` and :meth:`LLM.complete` take the HTTP API's request fields and apply its
rules, defaults and canvas fitting (``api/pipeline.py``): what the server would refuse
with a 400 raises :class:`InvalidRequestError`. :meth:`LLM.generate` and
:meth:`LLM.generate_ids` take engine-level :class:`DecodingParams` as given.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DEFAULT_STEPS, DecodingParams
from dllm_serve.engine.engine import AsyncEngine, EngineDeadError
from dllm_serve.engine.workers import launch
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_served_draft_lora
from dllm_serve.offline_batch import Completion, run_together

if TYPE_CHECKING:
    from dllm_serve.api.pipeline import ModelFacts, RequestSpec

__all__ = ["LLM", "Completion", "InvalidRequestError"]


# What each offline call takes a list of (named in its type errors).
_ITEMS = {"messages": "conversations", "prompt": "prompts"}


class InvalidRequestError(ValueError):
    """What the HTTP API answers with a 400: ``param`` is the field at fault, ``code`` the
    stable reason (``unsupported_parameter``, ``context_length_exceeded``, …) or None."""

    def __init__(self, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class LLM:
    """Loads a model, owns an :class:`AsyncEngine`, and generates batches of conversations.

    All conversations of one :meth:`generate` call are submitted together, so the engine
    batches them exactly as it batches concurrent HTTP requests.
    """

    def __init__(
        self,
        model: str = "demo-llada",
        *,
        device: str = "auto",
        dtype: str = "auto",
        engine_config: EngineConfig | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        draft_lora: str | None = None,
    ) -> None:
        """``draft_lora``: a tri-mode model's draft-only LoRA (the server's ``--draft-lora``).
        ``engine_config``'s waiting limit is lifted: offline callers submit whole datasets."""
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(
                f"engine_config must be a dllm_serve.config.EngineConfig, got "
                f"{type(engine_config).__name__}"
            )
        size = tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if expert_parallel and tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1")
        if tensor_parallel_size > 1:  # worker processes hold the other shards
            loaded = launch(
                model,
                device,
                dtype,
                tensor_parallel_size,
                draft_lora=draft_lora,
                expert_parallel=expert_parallel,
            )
        else:
            loaded = load_model(model, device=device, dtype=dtype)
        self._start(loaded, engine_config, draft_lora)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, engine_config: EngineConfig | None = None) -> LLM:
        """An LLM over an already loaded (or built) model, e.g. random weights for benchmarks."""
        llm = cls.__new__(cls)
        llm._start(loaded, engine_config)
        return llm

    def _start(
        self, loaded: LoadedModel, engine_config: EngineConfig | None, draft_lora: str | None = None
    ) -> None:
        self.loaded = loaded
        # Offline callers submit whole datasets at once: queue them all instead of refusing
        # them at the server's waiting limit, whatever engine_config says.
        config = dataclasses.replace(engine_config or EngineConfig(), max_waiting_requests=1 << 30)
        try:
            if draft_lora is not None:
                # Rank 0's shard too (under tensor parallelism the workers attach their own);
                # a model that does not draft is refused.
                attach_served_draft_lora(loaded, draft_lora)
            self.engine = AsyncEngine(self.loaded, config)
        except BaseException:
            # A refused config must not leave the tensor-parallel workers and the process group
            # behind: every later LLM(tensor_parallel_size=N) in the process would fail.
            if loaded.parallel is not None:
                loaded.parallel.stop()
            raise
        self.engine.start()
        # Stops the engine thread (which keeps the weights alive) when the LLM is collected
        # without close(); it holds the engine, never the LLM.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    @functools.cached_property
    def _facts(self) -> ModelFacts:
        # The API's request pipeline is imported on first use only: generate() and the
        # benchmarks run where the web stack (fastapi, pydantic) is not installed.
        from dllm_serve.api.pipeline import ModelFacts

        return ModelFacts(self.engine)

    def chat(
        self, conversations: Sequence[Sequence[dict[str, Any]]], **fields: Any
    ) -> list[Completion]:
        """One chat completion per conversation, with the HTTP API's request fields
        (``max_tokens``, ``temperature``, ``seed``, ``stop``, ``num_denoising_steps``,
        ``decoding_mode``, …: docs/api.md) shared by all, and its rules, defaults and canvas
        fitting. A request the server would refuse raises :class:`InvalidRequestError`."""
        from dllm_serve.api.pipeline import chat_request

        return self._requests(chat_request, "messages", conversations, fields)

    def complete(self, prompts: Sequence[str | Sequence[int]], **fields: Any) -> list[Completion]:
        """One text completion per raw prompt (a string, no chat template, or token ids), as
        ``/v1/completions`` does; fields and rules as in :meth:`chat`."""
        from dllm_serve.api.pipeline import completion_request

        return self._requests(completion_request, "prompt", prompts, fields)

    def _requests(
        self,
        pipeline: Callable[[ModelFacts, bytes, str | None], tuple[RequestSpec, list[int]]],
        field: str,
        items: Sequence[Any],
        fields: dict[str, Any],
    ) -> list[Completion]:
        """Each item as the body ``{field: item, **fields}`` through the API's pipeline."""
        from dllm_serve.api.errors import APIError

        if field in fields:
            raise ValueError(f"pass the {field} as the first argument, not as {field}=")
        if "stream" in fields:
            raise ValueError("stream is HTTP only: the offline API returns whole completions")
        if fields.get("n") not in (None, 1):
            raise ValueError(
                "n > 1 is HTTP only: the offline API returns one completion per item; repeat "
                "the item n times (with seed + i for the same answers as the server's choices)"
            )
        # A bare string would be one completion per character, and chat(messages) without the
        # outer list would blame the first message for not being a list.
        if isinstance(items, str | bytes) or not isinstance(items, Sequence):
            raise TypeError(f"give a list of {_ITEMS[field]}, got {type(items).__name__}")
        if field == "messages" and items and isinstance(items[0], dict):
            raise TypeError(
                "give a list of conversations (each a list of messages), got a list of "
                "messages: wrap one conversation as [messages]"
            )
        specs = []
        for i, item in enumerate(items):
            try:
                body = json.dumps({field: item, **fields}).encode()
            except (TypeError, ValueError) as exc:
                raise ValueError(f"request {i} is not JSON: {exc}") from None
            try:
                specs.append(pipeline(self._facts, body, "application/json"))
            except APIError as exc:
                error = exc.body()["error"]
                if exc.status != 400:  # not the request's fault: a closed or failed engine
                    kind = EngineDeadError if error["code"] == "engine_dead" else RuntimeError
                    raise kind(f"request {i}: {error['message']}") from None
                raise InvalidRequestError(
                    f"request {i}: {error['message']}", error["param"], error["code"]
                ) from None
        requests = [(ids, spec.params, spec.stop, spec.include_stop_str) for spec, ids in specs]
        return run_together(self.engine, requests)

    def generate(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        params: DecodingParams | Sequence[DecodingParams] | None = None,
        stop: str | Sequence[str] = (),
    ) -> list[Completion]:
        """Generate one completion per conversation (``params`` per conversation or shared),
        with engine-level parameters taken as given; :meth:`chat` applies the API's rules."""
        if params is None:  # the server's defaults: the model's canvas, and its steps
            length = self.engine.default_gen_length
            # A block model's steps are per block: one token per step in its trained block.
            steps = self.loaded.block_size or min(DEFAULT_STEPS, length)
            params = DecodingParams(gen_length=length, steps=steps)
        prompts = [self.engine.chat_prompt_ids(list(c)) for c in conversations]
        return self.generate_ids(prompts, params, stop)

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        params: DecodingParams | Sequence[DecodingParams],
        stop: str | Sequence[str] = (),
    ) -> list[Completion]:
        """Generate from prompt token ids (already templated), ``params`` per prompt or
        shared; the parameters are taken as given (no API defaults or canvas fitting)."""
        if isinstance(params, DecodingParams):
            params = [params] * len(prompts)
        if not all(isinstance(p, DecodingParams) for p in params):
            raise TypeError("params must be a DecodingParams or one per prompt (the API's "
                            "request fields are for chat() and complete())")  # fmt: skip
        if len(params) != len(prompts):
            raise ValueError("give one DecodingParams per prompt, or a single one")
        if isinstance(stop, str):  # one stop string, as the API accepts it
            stop = [stop]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self._check(i, prompt, p)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        stops = tuple(stop)
        requests = [(list(p), q, stops, False) for p, q in zip(prompts, params, strict=True)]
        return run_together(self.engine, requests)

    def _check(self, i: int, prompt: Sequence[int], params: DecodingParams) -> None:
        """What the server checks before a request runs, as a ValueError here (not a failed
        generation after a logged traceback, nor an index error inside the forward)."""
        loaded = self.loaded
        vocab = loaded.vocab_size
        if not isinstance(prompt, Sequence) or isinstance(prompt, str | bytes):
            raise TypeError(
                f"prompt {i} must be a list of token ids, got {type(prompt).__name__} "
                "(a tensor or array: .tolist())"
            )
        if not prompt:
            raise ValueError(f"prompt {i} is empty: it needs at least one token")
        for what, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids)):
            for token in ids:
                if not isinstance(token, int) or isinstance(token, bool):
                    raise ValueError(f"{what} of request {i}: {token!r} is not a token id")
                if vocab and not 0 <= token < vocab:
                    raise ValueError(
                        f"{what} of request {i}: token id {token} is outside the vocabulary "
                        f"(0 to {vocab - 1})"
                    )
                if token == loaded.mask_id:
                    raise ValueError(f"{what} of request {i}: {token} is the mask token")
        if len(prompt) + params.gen_length > loaded.max_length:
            raise ValueError(
                f"request {i}: {len(prompt)} prompt tokens + gen_length {params.gen_length} "
                f"exceed the model's context of {loaded.max_length} tokens"
            )

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
