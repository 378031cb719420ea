"""Offline API: the same engine as the server, without HTTP, for scripts and benchmarks.

from dllm_serve import LLM, DecodingParams
with LLM("tiny-llada") as llm:
    [out] = llm.generate([[{"role": "user", "content": "Hi"}]], DecodingParams(gen_length=32))
    print(out.text, out.finish_reason, out.nfe)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import uuid6

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DEFAULT_STEPS, DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished generation."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    nfe: int  # forward passes this request took part in
    committed: int = 0  # canvas positions decoded (answer + EOS padding)
    drafted: int = 0  # self-speculation (ISD, LinearSpec): drafts verified ...
    accepted_drafts: int = 0  # ... and accepted


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
    ) -> None:
        if tensor_parallel_size > 1:  # worker processes hold the other shards
            from dllm_serve.engine.tensor_parallel import launch

            loaded = launch(
                model, device, dtype, tensor_parallel_size, expert_parallel=expert_parallel
            )
        else:
            loaded = load_model(model, device=device, dtype=dtype)
        self._start(loaded, engine_config)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, engine_config: EngineConfig | None = None) -> LLM:
        """An LLM over an already loaded (or built) model, e.g. random weights for benchmarks."""
        llm = cls.__new__(cls)
        llm._start(loaded, engine_config)
        return llm

    def _start(self, loaded: LoadedModel, engine_config: EngineConfig | None) -> None:
        self.loaded = loaded
        # Offline callers submit whole datasets at once: queue them all instead of refusing.
        config = engine_config or EngineConfig(max_waiting_requests=1 << 30)
        try:
            self.engine = AsyncEngine(self.loaded, config)
        except BaseException:
            # Found by QA: a refused config left the tensor-parallel workers and the process
            # group behind, and every later LLM(tensor_parallel_size=N) in the process failed.
            if loaded.parallel is not None:
                loaded.parallel.stop()
            raise
        self.engine.start()

    def generate(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        params: DecodingParams | Sequence[DecodingParams] | None = None,
        stop: Sequence[str] = (),
    ) -> list[Completion]:
        """Generate one completion per conversation (``params`` per conversation or shared)."""
        if params is None:  # the server's defaults: the model's canvas, and its steps
            length = self.engine.default_gen_length
            # A block model's steps are per block: one token per step in its trained block.
            steps = self.loaded.block_size or min(DEFAULT_STEPS, length)
            params = DecodingParams(gen_length=length, steps=steps)
        if isinstance(params, DecodingParams):
            per_row = [params] * len(conversations)
        else:
            per_row = list(params)
            if len(per_row) != len(conversations):
                raise ValueError("give one DecodingParams per conversation, or a single one")
        prompts = [self.engine.chat_prompt_ids(list(c)) for c in conversations]
        return self.generate_ids(prompts, per_row, stop)

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[DecodingParams],
        stop: Sequence[str] = (),
    ) -> list[Completion]:
        """Generate from prompt token ids (already templated), one ``params`` per prompt."""
        if len(params) != len(prompts):
            raise ValueError("give one DecodingParams per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self._check(i, prompt, p)
        return asyncio.run(self._run([list(p) for p in prompts], list(params), tuple(stop)))

    def _check(self, i: int, prompt: Sequence[int], params: DecodingParams) -> None:
        """What the server checks before a request runs, as a ValueError here (not a failed
        generation after a logged traceback, nor an index error inside the forward)."""
        loaded = self.loaded
        vocab = loaded.vocab_size
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

    async def _run(
        self, prompts: list[list[int]], params: list[DecodingParams], stop: tuple[str, ...]
    ) -> list[Completion]:
        async def collect(outputs: AsyncIterator[RequestOutput]) -> Completion:
            parts, last = [], None
            async for output in outputs:
                parts.append(output.delta_text)
                last = output
            assert last is not None
            if last.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"generation failed: {last.error or last.finish_reason}")
            return Completion(
                "".join(parts),
                last.finish_reason,
                last.prompt_tokens,
                last.completion_tokens,
                last.nfe,
                last.committed,
                last.drafted or 0,
                last.accepted_drafts or 0,
            )

        engine = self.engine
        ids = [str(uuid6.uuid7()) for _ in prompts]
        streams = []
        try:
            with engine.submitting_together():  # the first step admits the whole batch
                for prompt, p, request_id in zip(prompts, params, ids, strict=True):
                    streams.append(
                        engine.generate(prompt, p, request_id, stop=stop, final_only=True)
                    )
        except BaseException:
            for request_id in ids[: len(streams)]:  # never started, so never aborted by them
                engine.abort(request_id)
            raise
        return list(await asyncio.gather(*(collect(s) for s in streams)))

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
