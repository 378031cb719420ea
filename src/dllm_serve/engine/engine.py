"""AsyncEngine: the asyncio-facing engine and the one thread that owns the model.

The event loop only enqueues requests, awaits their outputs and aborts them; every forward
runs on the engine thread, so ``/health`` and other requests never wait for a step. One
iteration of the thread reads: take new requests and aborts → admit → for each group of rows:
prepare → one batched forward → per-row update → emit → free finished rows.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH
from dllm_serve.engine.algorithms import algorithm_for, default_mode
from dllm_serve.engine.kv_budget import KVBudget, KVCapacityError, pool_slots
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.observer import EngineObserver, NullObserver
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import QueueFullError, Scheduler
from dllm_serve.engine.steps import EngineSteps, Sink
from dllm_serve.engine.submission import EngineDeadError, EngineSubmission
from dllm_serve.engine.tokenizer_pool import TokenizerPool
from dllm_serve.models.loader import LoadedModel, decode_answer

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "KVCapacityError", "QueueFullError"]


class AsyncEngine(EngineSubmission, EngineSteps):
    """submit → async stream of :class:`RequestOutput`, abort, shutdown (how requests come in
    and leave early: ``engine/submission.py``; one step of the thread: ``engine/steps.py``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.observer: EngineObserver = observer or NullObserver()
        self.algorithm = algorithm_for(loaded, self.config, lambda: len(self.scheduler.running))
        # "diffusion" (canvas denoising), "block_diffusion" (SDAR), "self_speculation"
        # (I-DLM ISD) or "tri_mode" (per request): the API rejects request fields that do not
        # apply to the model's mode, and a request's decoding_mode the model does not have.
        self.decoding_mode = self.algorithm.decoding_mode
        self.default_decoding_mode = default_mode(self.algorithm)
        self.runner = ModelRunner(
            loaded.model,
            loaded.device,
            kv_slots=pool_slots(loaded, self.config, self.algorithm),
            parallel=loaded.parallel,
            cuda_graph=self.config.cuda_graph and loaded.device.type == "cuda",
            graph_max_rows=self.config.max_running_requests,
            mask_id=loaded.mask_id,
        )
        self.kv = KVBudget(self.runner.pool, self.algorithm)
        self.scheduler = Scheduler(self.config)
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._abort_all_reason: str | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._kv_blocked = False  # set by each admission pass (engine/steps.py)
        self._tokenizers = TokenizerPool(loaded)
        # The engine thread detokenises with its own copy of the tokenizer, so it never waits
        # for (or blocks) the API's chat templating, which borrows the pool's copies.
        self._detok_tokenizer = copy.deepcopy(loaded.tokenizer)
        self._thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def max_length(self) -> int:
        return self.loaded.max_length

    @property
    def default_gen_length(self) -> int:
        """The canvas of a request that sets no max_tokens: the model's own, else 128."""
        return self.loaded.default_gen_length or DEFAULT_GEN_LENGTH

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # the engine thread no longer drives the workers
            self.runner.close()

    # ---- tokenizer (called from worker threads of the event loop) ----------------------------
    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        with self._tokenizers.borrow() as model:
            return model.chat_prompt_ids(messages)

    def prompt_ids(self, text: str) -> list[int]:
        """A raw prompt's token ids (no chat template; /v1/completions)."""
        with self._tokenizers.borrow() as model:
            return model.prompt_ids(text)

    def _decode(self, ids: Sequence[int]) -> str:
        """Engine thread only (its own tokenizer copy; see ``__init__``)."""
        return decode_answer(self._detok_tokenizer, ids)

    # ---- requests --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool held by running requests (read by the metrics scrape)."""
        return self.kv.reserved_bytes

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
        except BaseException as exc:  # a bug in the loop itself: fail everyone, report dead
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            reason = "engine stopped" if self._dead is None else f"engine died: {self._dead!r}"
            with self._cond:
                pending = [*self._inbox, *self.scheduler.waiting, *self.scheduler.running]
                self._inbox.clear()
                self.scheduler.waiting.clear()
                self.scheduler.running.clear()
            for request in pending:
                self._fail(request, "error", reason)
            self._flush()

    def _iterate(self) -> bool:
        with self._cond:
            while not self._has_work():
                self._cond.wait()
            if self._stopping:
                return False
            self.scheduler.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
            abort_all, self._abort_all_reason = self._abort_all_reason, None
        started = time.perf_counter()
        now = time.monotonic()
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if abort_all is not None:
                self._fail(request, "abort", abort_all)
            elif request.request_id in aborts:
                self._fail(request, "abort")
            elif request.deadline is not None and now >= request.deadline:
                self._fail(request, "timeout", "the request exceeded its time limit")
        self._admit()
        for group in self.scheduler.groups():
            self._forward(group)
        if not self.scheduler.running:
            self._flush()  # nothing runs next: deliver now rather than with the next forward
        self.observer.on_iteration(time.perf_counter() - started)
        return True

    def _has_work(self) -> bool:
        sched = self.scheduler
        return bool(
            self._stopping
            or self._inbox
            or self._aborts
            or self._abort_all_reason
            or sched.running
            or sched.waiting
        )
