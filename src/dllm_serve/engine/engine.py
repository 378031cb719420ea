"""AsyncEngine: the asyncio-facing engine and the one thread that owns the model.

The event loop only submits requests, awaits their outputs and aborts them; every forward runs
on the engine thread, so ``/health`` and other requests never wait for a step. The thread
repeats :meth:`AsyncEngine.step`::

    take new requests and aborts  →  admit (slots, KV budget)  →  for each forward of this step:
    prepare each row (host)  →  ModelRunner.run (one batched forward)  →  algorithm.sample
    (device)  →  one device→host copy  →  commit each row (host)  →  emit its final text

Its collaborators each own one piece of state: the :class:`~dllm_serve.engine.scheduler.Inbox`
(what other threads hand over, under its lock), the
:class:`~dllm_serve.engine.scheduler.Scheduler` (waiting and running requests), the
:class:`~dllm_serve.engine.model_runner.ModelRunner` (the device: weights, KV pool, forward),
the decoding algorithm (``decoding/registry.py``) and the
:class:`~dllm_serve.engine.outputs.Outbox` (outputs on their way to the event loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch
import uuid6

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DECODING_ALGORITHMS, DEFAULT_GEN_LENGTH, DecodingParams
from dllm_serve.decoding.protocol import PrefixReuse, RowSpec, as_step_logits
from dllm_serve.decoding.registry import (
    algorithm_for,
    check_request,
    decoding_algorithm,
    default_mode,
    logprob_modes,
    structured_output_refusals,
    supports_editing,
    supports_infilling,
    supports_insert_delete,
)
from dllm_serve.engine.graphs import graph_memory
from dllm_serve.engine.logprobs import after_commit as record_emitted
from dllm_serve.engine.logprobs import after_sample, before_sample, read_entries
from dllm_serve.engine.logprobs import mark as mark_emitted
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.outputs import (
    EngineObserver,
    IncrementalDetokenizer,
    NullObserver,
    Outbox,
    RequestOutput,
    Sink,
    snapshot,
    start_event,
    step_event,
)
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import (
    MAX_BYPASS,
    Aborts,
    Inbox,
    KVBudget,
    KVCapacityError,
    QueueFullError,
    Scheduler,
    pool_slots,
)
from dllm_serve.engine.tokenizer_pool import TokenizerPool
from dllm_serve.models.errors import DeviceFault, is_device_fault
from dllm_serve.models.loader import LoadedModel, decode_answer
from dllm_serve.models.prefix_cache import CachedChunk, PrefixCache

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "DeviceFault",
    "EngineDeadError",
    "KVCapacityError",
    "QueueFullError",
]


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


def attention_backend(name: str, device: torch.device, sdpa_only: bool = False) -> str:
    """``auto``: FlexAttention on CUDA (one kernel call per layer over the paged pool), SDPA on
    CPU (at the sizes a CPU serves, SDPA is several times faster than the compiled flex
    kernel, and needs no compile). ``sdpa_only``: a model whose attention runs on the SDPA
    groups only (DiffusionGemma's sliding windows and two modes) gets SDPA under ``auto``."""
    if name == "auto":
        return "flex" if device.type == "cuda" and not sdpa_only else "sdpa"
    return name


class AsyncEngine:
    """Submit → async stream of :class:`RequestOutput`, abort, shut down; one engine thread
    that runs :meth:`step` until it stops (see the module docstring)."""

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
        # "diffusion" (canvas denoising), "block_diffusion", "self_speculation" (I-DLM) or
        # "tri_mode" (per request): the API rejects request fields that do not apply to the
        # model's mode, and a request's decoding_mode the model does not have.
        self.decoding_mode = self.algorithm.decoding_mode
        self.default_decoding_mode = default_mode(self.algorithm)
        # Whether requests may ask for LLaDA2.1 token editing (edit_threshold).
        self.token_editing = supports_editing(self.algorithm)
        # Whether that editing is LLaDA2.2's insert/delete rule (JointThresholdInDel).
        self.insert_delete = supports_insert_delete(self.algorithm)
        # Whether a canvas may sit between the prompt and a suffix (/v1/completions suffix).
        self.infilling = supports_infilling(self.algorithm)
        # The request modes whose answer-token logprobs are recorded (engine/logprobs.py).
        self.logprob_modes = logprob_modes(self.algorithm)
        # Request mode → why response_format is not enforced there (decoding/grammar.py).
        self.structured_refusals = structured_output_refusals(self.algorithm)
        # --decoding-algorithm: the commit rule (request fields) of requests that choose none.
        self.decoding_algorithm = decoding_algorithm(loaded, self.config)
        self.default_commit_rule = dict(DECODING_ALGORITHMS[self.decoding_algorithm])
        sdpa_only = bool(getattr(loaded.model, "needs_row_inputs", False))
        attention = attention_backend(self.config.attention_backend, loaded.device, sdpa_only)
        graphs = self.config.cuda_graph and loaded.device.type == "cuda" and attention == "flex"
        # A block-routed MoE (LLaDA2.2) runs eagerly (ModelRunner): no graph memory to set aside.
        graphs = graphs and not getattr(loaded.model, "routing_block", 0)
        # The graphs' memory is set aside before the KV pool takes its share of what is free.
        reserve = 0
        if graphs:
            itemsize = loaded.model.embed_tokens.weight.element_size()
            reserve = graph_memory(loaded.model.config, self.config.cuda_graph_max_tokens, itemsize)
        self.runner = ModelRunner(
            loaded.model,
            loaded.device,
            kv_slots=pool_slots(loaded, self.config, self.algorithm, reserve),
            parallel=loaded.parallel,
            cuda_graph=graphs,
            graph_max_tokens=self.config.cuda_graph_max_tokens,
            mask_id=loaded.mask_id,
            attention=attention,
        )
        self.kv = KVBudget(self.runner.pool, self.algorithm)
        self.prefix_cache = self._prefix_cache(attention)
        # Canvas denoising rewrites its kept K/V at every block (decoding/canvas.py): its pages
        # are cached when it ends, never while it runs.
        self._refreshes_prefix = bool(getattr(self.algorithm, "refreshes_prefix", False))
        self.scheduler = Scheduler(self.config)
        self.inbox = Inbox()
        self.outbox = Outbox()
        self._dead: BaseException | None = None
        # Called on the engine thread once it has stopped for good (``_run``), after every
        # request got its final output: the server exits non-zero through one of these.
        self.on_dead: list[Callable[[BaseException], None]] = []
        # Set by each admission pass: the head of the queue waits for KV-pool room, so free
        # running slots do not help the queue now.
        self._kv_blocked = False
        self._tokenizers = TokenizerPool(loaded)
        # The engine thread detokenises with its own copy of the tokenizer, so it never waits
        # for (or blocks) the API's chat templating, which borrows the pool's copies.
        self._detok_tokenizer = copy.deepcopy(loaded.tokenizer)
        self._thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)

    def _prefix_cache(self, attention: str) -> PrefixCache | None:
        """The KV pool's prefix cache when ``--enable-prefix-caching`` allows it: on by default
        where reuse is exact (the algorithm keeps K/V that depend only on the tokens before
        them, causal or block-causal: :class:`~dllm_serve.decoding.protocol.PrefixReuse`).
        Canvas denoising (LLaDA, Dream, LLaDA-MoE) keeps K/V only with ``--kv-cache prefix``,
        and reusing them is approximate (decoding/canvas.py): on only when the flag asks,
        refused without ``--kv-cache prefix``.

        The FlexAttention backend's mask tells a key's request by its page's one owner, which
        a page shared by several requests does not have: with it a hit is *copied* into pages
        of the request's own before the next forward (the prefill is saved, not the memory);
        under tensor parallelism the copies travel with the rows to every rank."""
        wanted = self.config.enable_prefix_caching
        pool = self.runner.pool
        if wanted is False:
            return None
        why = None
        if pool is None or not isinstance(self.algorithm, PrefixReuse):
            why = "its decoding keeps no K/V that depend only on the tokens before them"
        elif getattr(self.algorithm, "refreshes_prefix", None) is False:
            why = (
                "canvas denoising keeps no K/V without --kv-cache prefix (it attends over the "
                "whole canvas); with it, reuse across requests is approximate and opt-in"
            )
        elif not getattr(self.algorithm, "prefix_reuse_exact", True) and not wanted:
            return None  # approximate reuse: only when the flag asks for it
        if why is not None:
            if wanted:
                raise ValueError(
                    f"--enable-prefix-caching: model {self.loaded.name!r} cannot reuse prefixes "
                    f"across requests: {why}; omit the flag or use --no-enable-prefix-caching"
                )
            return None
        assert pool is not None and isinstance(self.algorithm, PrefixReuse)
        copy_hits = attention == "flex"
        return pool.enable_prefix_cache(self.algorithm.prefix_alignment, copy_hits=copy_hits)

    # ---- lifecycle -----------------------------------------------------------------------------
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
    def dead(self) -> BaseException | None:
        """Why the engine thread stopped for good (None while it serves, or after a clean
        shutdown)."""
        return self._dead

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self.inbox.stopping

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.inbox.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # the engine thread no longer drives the workers
            self.runner.close()

    # ---- tokenizer (called from worker threads of the event loop) ------------------------------
    def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        with self._tokenizers.borrow() as model:
            return model.chat_prompt_ids(messages, tools)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template text (which tool-call format it renders)."""
        template = getattr(self.loaded.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def prompt_ids(self, text: str) -> list[int]:
        """A raw prompt's token ids (no chat template; /v1/completions)."""
        with self._tokenizers.borrow() as model:
            return model.prompt_ids(text)

    def suffix_ids(self, text: str) -> list[int]:
        """An infilling suffix's token ids (no special tokens; /v1/completions ``suffix``)."""
        with self._tokenizers.borrow() as model:
            return model.suffix_ids(text)

    def _decode(self, ids: Sequence[int]) -> str:
        """Engine thread only (its own tokenizer copy; see ``__init__``)."""
        return decode_answer(self._detok_tokenizer, ids)

    # ---- requests in and out (any thread) ------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.inbox.requests)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool reserved by running requests (read by the metrics scrape)."""
        return self.kv.reserved_bytes

    @property
    def kv_pages(self) -> tuple[int, int]:
        """(pages requests hold now, pages in the pool); (0, 0) without a pool."""
        pool = self.runner.pool
        return (0, 0) if pool is None else (pool.pages_used, pool.num_pages)

    @property
    def prefix_cache_pages(self) -> tuple[int, int]:
        """(pages the prefix cache holds, of which idle: cached, pinned by no running request);
        (0, 0) without the cache. Read by the metrics scrape (two integer reads)."""
        cache = self.prefix_cache
        return (0, 0) if cache is None else (cache.cached_pages, cache.idle_pages)

    def generate(
        self,
        prompt_ids: list[int],
        params: DecodingParams,
        request_id: str | None = None,
        **options: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request now and return the async iterator of its outputs (``options``:
        those of :meth:`submit`). Closing the iterator before the last output aborts the
        request."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = self.submit(
            prompt_ids, params, queue.put_nowait, request_id, loop=loop, **options
        )
        return self._outputs(request_id, queue)

    def submit(
        self,
        prompt_ids: list[int],
        params: DecodingParams,
        sink: Sink,
        request_id: str | None = None,
        *,
        stop: Sequence[str] = (),
        timeout: float | None = None,
        trace: bool = False,
        final_only: bool = False,
        include_stop: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> str:
        """Submit a request now: ``sink`` receives each of its outputs, the last one with
        ``finished`` set, on ``loop`` (:meth:`generate`) or, without one, on the engine thread
        itself (a synchronous consumer such as the offline LLM; it must return at once).
        Returns the request id (for :meth:`abort`).

        Submission is eager, so a full queue raises :class:`QueueFullError` (and a stopped
        engine :class:`EngineDeadError`) here. With ``timeout`` (seconds), the request ends
        with ``finish_reason == "timeout"`` at the first step boundary past it. ``trace``:
        every step's output carries its trace event (``outputs.py``). ``include_stop``: the
        answer ends *after* the stop string it matched, not before (vLLM's
        ``include_stop_str_in_output``); the token count is the same either way.
        ``final_only`` (a caller that only joins the deltas): the answer is decoded once and
        arrives whole in the last output, with no output before it, so no step pays for
        detokenising or a hand-off. It has no effect with ``stop`` strings (matched step by
        step, so a stop string ends decoding early) or ``trace``.
        """
        check_request(self.algorithm, self.loaded.name, params)
        request = Request(
            request_id=request_id or str(uuid6.uuid7()),
            prompt_ids=list(prompt_ids),
            params=params,
            sink=sink,
            detokenizer=IncrementalDetokenizer(
                self._decode, stop=tuple(stop), include_stop=include_stop
            ),
            loop=loop,
            trace=trace,
            final_only=final_only and not stop and not trace,
        )
        if timeout is not None:
            request.deadline = request.arrival_time + timeout
        self._submit(request)
        return request.request_id

    def _submit(self, request: Request) -> None:
        """Queue ``request`` for the engine thread: refused here when it can never fit the KV
        pool, when the engine is not running, or when the waiting queue is full."""
        self.kv.check(len(request.prompt_ids), request.params)
        with self.inbox.lock:
            if self._dead is not None or self.inbox.stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine is not running")
            # Counting this request too, so a limit of 0 means "no queue", not "no requests".
            waiting = self.num_waiting + 1 - self._starting(request)
            if waiting > self.config.max_waiting_requests:
                raise QueueFullError(
                    f"{waiting - 1} request(s) already waiting "
                    f"(limit {self.config.max_waiting_requests})"
                )
            self.inbox.put(request)

    def _starting(self, request: Request) -> int:
        """How many of the queue (``request`` last) the next admission pass can start: as many
        as there are free running slots, in order, while their K/V fits the free pool. So a
        burst that reaches an idle engine counts as waiting as soon as the pool holds it back,
        not only after an admission pass has seen it blocked."""
        free_slots = self.config.max_running_requests - len(self.scheduler.running)
        if self._kv_blocked or free_slots <= 0:
            return 0
        # A snapshot of the head only (``islice`` runs in C, so the engine thread, which pops
        # from ``waiting`` without the inbox's lock, cannot change it midway).
        head = [
            *islice(self.scheduler.waiting, free_slots),
            *islice(self.inbox.requests, free_slots),
        ]
        return self.kv.startable([*head, request][:free_slots])

    async def _outputs(
        self, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    @contextlib.contextmanager
    def submitting_together(self) -> Iterator[None]:
        """Requests submitted inside this block reach the engine thread together, so its next
        step admits them all (a batch that arrived one by one would start with a step of one
        row and take an extra forward). Holds the inbox's lock: submit and leave quickly."""
        with self.inbox.lock:
            yield

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its row and state are freed before the next step."""
        self.inbox.abort(request_id)

    def abort_all(self, reason: str) -> None:
        """Abort every queued and running request (shutdown); each gets ``reason`` as error."""
        self.inbox.abort_all(reason)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self.step():
                    pass
        except BaseException as exc:  # a device fault, or a bug in the loop itself
            if isinstance(exc, DeviceFault):
                logger.critical("device fault, the engine stops: %s", exc.__cause__ or exc)
            else:
                logger.exception("engine loop died")
            self._dead = exc
        finally:
            reason = "engine stopped" if self._dead is None else f"engine died: {self._dead!r}"
            for request in self.inbox.drain(self.scheduler):
                try:
                    self._fail(request, "error", reason)
                except Exception:  # one failing hand-off must not cost the others theirs
                    logger.exception("final output of %s lost", request.request_id)
            self.outbox.flush()
            if self._dead is not None:
                for callback in self.on_dead:
                    callback(self._dead)

    def step(self) -> bool:
        """One iteration: every running request advances by exactly one step. Returns False
        once the engine is stopping (it waits while there is nothing to do)."""
        aborts = self.inbox.take(self.scheduler)
        if aborts is None:
            return False
        started = time.perf_counter()
        self._end_early(aborts)
        self._admit()
        for group in self.scheduler.groups():  # the forwards of this step, rows packed
            self._forward(group)
        if not self.scheduler.running:
            self.outbox.flush()  # nothing runs next: deliver now rather than with the next forward
        self.observer.on_iteration(time.perf_counter() - started)
        return True

    def _forward(self, group: list[Request]) -> None:
        """One forward for ``group``: prepare → run → sample → one device→host copy → commit.

        A failure while preparing or committing one row fails only that request; a failure of
        the forward or the batched sampler fails the rows of this forward.
        """
        rows, specs = self._prepare(group)
        if not rows:
            return
        states = [r.state for r in rows]
        # The previous forward's outputs go now: the event loop's work on them overlaps this
        # forward's kernels (which release the GIL) instead of host work.
        self.outbox.flush()
        try:
            logits = as_step_logits(self.runner.run(specs))
            asking = before_sample(states, logits, self.loaded.mask_id)
            sampled = self.algorithm.sample(states, logits)
            after_sample(asking, sampled, self.loaded.mask_id)
            # The step's one device→host copy: every row's commits or verdicts.
            host = sampled.tolist()
        except Exception as exc:
            if is_device_fault(exc):  # nothing can run on this device any more
                raise DeviceFault(f"{type(exc).__name__}: {exc}") from exc
            for request in rows:
                self._fail_exc(request, exc, "forward")
            return
        tokens = sum(len(s.tokens) for s in specs)
        self.observer.on_forward(
            len(rows), tokens, self.runner.forward_seconds(), self.runner.last_graphed
        )
        self._commit(rows, host, logits.width)

    def _end_early(self, aborts: Aborts) -> None:
        """Aborted and timed-out requests end before the step (waiting or running)."""
        now = time.monotonic()
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if aborts.all is not None:
                self._fail(request, "abort", aborts.all)
            elif request.request_id in aborts.ids:
                self._fail(request, "abort")
            elif request.deadline is not None and now >= request.deadline:
                self._fail(request, "timeout", "the request exceeded its time limit")

    def _admit(self) -> None:
        """Start waiting requests, in order, while running slots and the KV pool allow.

        A request whose worst-case KV does not fit the unreserved pages now waits, and the
        requests behind it that do fit may start before it — at most
        :data:`~dllm_serve.engine.scheduler.MAX_BYPASS` of them, after which everyone waits
        for it (running requests always finish and give their pages back, so it starts).
        One that could never fit the whole pool was refused at submission
        (``KVCapacityError``).
        """
        pool = self.runner.pool
        self._kv_blocked = False
        blocked: list[Request] = []  # popped, but waiting for pages: back at the head, in order
        try:
            for request in self.scheduler.admit():
                if blocked and blocked[0].bypassed >= MAX_BYPASS:
                    blocked.append(request)  # the head has waited long enough: nobody passes
                    break
                # A request popped from the queue is in no list until it runs: whatever fails
                # from here on must finish it, or it would never get an output.
                try:
                    need = self.kv.need(len(request.prompt_ids), request.params)
                except Exception as exc:
                    self._fail_exc(request, exc, "admission")
                    continue
                span = None
                if need and pool is not None:
                    try:
                        hit = self._prefix_hit(request, need)
                    except Exception as exc:
                        self._fail_exc(request, exc, "admission")
                        continue
                    span = pool.reserve(need, hit)
                    if span is None:
                        blocked.append(request)
                        self._kv_blocked = True
                        continue
                try:
                    request.state = self.algorithm.init_state(
                        request.prompt_ids, request.params, self.loaded.device
                    )
                    request.state.kv = span
                    if span is not None and span.length:  # a prefix hit (shared or copied)
                        assert isinstance(self.algorithm, PrefixReuse)
                        self.algorithm.reuse_prefix(request.state, span.length)
                except Exception as exc:
                    if span is not None and pool is not None:
                        pool.free(span)  # unpins the hit; caches nothing
                    if request.state is not None:
                        request.state.kv = None
                    self._fail_exc(request, exc, "admission")
                    continue
                if self.prefix_cache is not None:
                    request.cached_tokens = span.length if span is not None else 0
                if request.trace and hasattr(request.state, "report_confidence"):
                    request.state.report_confidence = True  # commit confidences for the trace
                self.scheduler.run(request)
                if self.prefix_cache is not None:  # once it runs: a failing hook loses nothing
                    self.observer.on_prefix_cache(len(request.prompt_ids), request.cached_tokens)
                if blocked:
                    blocked[0].bypassed += 1
        finally:
            self.scheduler.waiting.extendleft(reversed(blocked))

    def _prefix_hit(self, request: Request, need: int) -> list[CachedChunk]:
        """The prefix-cache chunks ``request`` may start from (none without the cache): the
        longest cached chain its prompt starts with, within what its algorithm lets it take
        and short of its whole reservation."""
        cache = self.prefix_cache
        if cache is None:
            return []
        assert isinstance(self.algorithm, PrefixReuse)
        limit = self.algorithm.prefix_limit(len(request.prompt_ids), request.params)
        return cache.match(request.prompt_ids, min(limit, need - 1))

    def _prepare(self, group: list[Request]) -> tuple[list[Request], list[RowSpec]]:
        """Each row's tokens and logit positions (the rows whose ``prepare`` succeeded)."""
        rows, specs = [], []
        prepare = self.algorithm.prepare
        for request in group:
            try:
                spec = prepare(request.state)
                # Checked here, per row, so a decoder bug fails its own request only, not
                # every row the batch packer would have refused with it.
                spec.check()
                specs.append(spec)
                rows.append(request)
            except Exception as exc:
                self._fail_exc(request, exc, "prepare")
        return rows, specs

    def _commit(self, rows: list[Request], host: list[list[int]], width: int) -> None:
        """Write each row's result into its state and emit what it made final; a failure
        fails that row only. ``width``: the logits per row (a traced row's commit
        confidences follow its first ``width`` entries)."""
        commit = self.algorithm.commit
        for request, row in zip(rows, host, strict=True):
            state = request.state
            try:
                before = snapshot(state, row, width) if request.trace else None
                marked = mark_emitted(state)
                result = commit([state], [row])[0]
                if marked is not None:
                    record_emitted(state, marked)
                if state.kv is not None and not result.finished:
                    self.runner.pool.trim(state.kv)  # pages past what the request keeps
                    if self.prefix_cache is not None and not self._refreshes_prefix:
                        # Its kept full chunks, for others now (a decoder that rewrites its
                        # kept K/V while it runs caches them when it ends instead).
                        kept = functools.partial(_kept_token_ids, request.prompt_ids, state)
                        self.prefix_cache.publish(state.kv, kept)
                events = None
                if before is not None:
                    events = (step_event(state, before, self._piece),)
                    if not request.trace_started:
                        request.trace_started = True
                        events = (start_event(state), *events)
                self._emit(
                    request, result.finished, result.finish_reason, result.new_tokens, events
                )
            except Exception as exc:
                self._fail_exc(request, exc, "update")

    def _piece(self, token: int) -> str:
        """One token's text, for trace events (specials included: EOS shows as EOS)."""
        return self._detok_tokenizer.decode([token], skip_special_tokens=False)

    def _emit(
        self,
        request: Request,
        finished: bool,
        finish_reason: str | None,
        new_tokens: int,
        events: tuple[dict, ...] | None = None,
    ) -> None:
        state = request.state
        assert state is not None
        if not finished and events is None:
            if not new_tokens:
                return  # nothing became final: no delta, no decode
            if request.final_only:
                # Nobody reads a delta before the end: decode the answer once, at the end.
                # Its first final token is when content first exists (the metric's moment).
                if request.first_content_time is None:
                    self._first_content(request)
                return
        tokens = state.answer_tokens()
        detok = request.detokenizer
        delta = detok.update(tokens, final=finished)
        count = len(tokens)
        if detok.stopped:  # a stop string ended the answer: tokens after it do not count
            finished, finish_reason = True, "stop"
            count = detok.stop_tokens if detok.stop_tokens is not None else count
        if delta and request.first_content_time is None:
            self._first_content(request)
        entries = None
        if request.params.logprobs is not None:
            entries = self._logprobs(request, count)
        # Entries go out as soon as their tokens are final, even when the detokenizer holds
        # their text back (an incomplete character): they are never dropped.
        if delta or finished or events is not None or entries:
            output = request.output(
                delta, count, finish_reason if finished else None, None, events, entries
            )
            self._send(request, output)

    def _logprobs(self, request: Request, count: int) -> tuple:
        """The logprob entries of the answer tokens that became final since the last output,
        with each token's text (the API shapes them)."""
        start, request.logprobs_sent = request.logprobs_sent, max(request.logprobs_sent, count)
        piece = self._piece
        return tuple(
            (piece(token), lp, tuple((piece(t), alt) for t, alt in alternatives))
            for token, lp, alternatives in read_entries(request.state, start, count)
        )

    def _first_content(self, request: Request) -> None:
        request.first_content_time = time.monotonic()
        self.observer.on_first_content(request.first_content_time - request.arrival_time)

    def _fail_exc(self, request: Request, exc: Exception, where: str) -> None:
        logger.exception("request failed in %s", where, extra={"request_id": request.request_id})
        self._fail(request, "error", f"{type(exc).__name__}: {exc}")

    def _fail(self, request: Request, reason: str, error: str | None = None) -> None:
        state = request.state
        answer = len(state.answer_tokens()) if state is not None else 0
        self._send(request, request.output("", answer, reason, error))

    def _send(self, request: Request, output: RequestOutput) -> None:
        if output.finished:
            # Free the slot and the KV before the client hears about it, so counts are never
            # stale.
            self.scheduler.remove(request)
            self._release_kv(request, output.finish_reason)
            self.observer.on_finished(output, time.monotonic() - request.arrival_time)
        self.outbox.put(request.sink, output, request.loop)

    def _release_kv(self, request: Request, reason: str | None = None) -> None:
        """Give the request's pages back; with the prefix cache, the full chunks of what it
        kept (its prompt and committed answer: K/V computed from final tokens only) stay
        cached for the next requests — not after an error, whose K/V nobody vouches for."""
        state = request.state
        if state is not None and state.kv is not None:
            assert self.runner.pool is not None
            tokens = None
            if self.prefix_cache is not None and reason != "error":
                tokens = _kept_token_ids(request.prompt_ids, state)
            self.runner.pool.free(state.kv, tokens)
            state.kv = None


def _kept_token_ids(prompt_ids: list[int], state: Any) -> list[int]:
    """The token ids at the first positions of a request's KV span: a canvas decoder's canvas
    (its kept positions are committed, final tokens), else the prompt and the answer emitted
    so far (a self-speculative span keeps ``prompt + emitted[:-1]``). Where the kept length
    runs past these (a stop id the answer drops), the cache keeps only what they cover."""
    canvas = getattr(state, "tokens", None)
    if isinstance(canvas, list):
        return canvas
    return prompt_ids + state.answer_tokens()
