"""Admission by KV budget: how big the KV pool is, what a request reserves in it, and how much
of the waiting queue the next admission pass can start.

Each request reserves one span for its worst case when it starts (``kv_tokens`` of its
algorithm); one whose worst case is larger than the whole pool could never run, so it is
refused when it is submitted (:class:`KVCapacityError`, an HTTP 400) rather than failing when
it reaches the head of the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.request import Request
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.loader import LoadedModel

if TYPE_CHECKING:
    from dllm_serve.decoding.algorithm import DecodingAlgorithm


class KVCapacityError(ValueError):
    """The request's worst-case K/V is larger than the whole KV pool: it could never run."""


def pool_slots(loaded: LoadedModel, config: EngineConfig, algorithm: DecodingAlgorithm) -> int:
    """Slots of the engine's KV pool (0: the algorithm keeps no K/V): room for every running
    request at the longest context, unless ``--kv-cache-memory`` (or free memory) says less."""
    longest = algorithm.kv_tokens(loaded.max_length - 1, DecodingParams(gen_length=1))
    if not longest:
        if config.kv_cache_memory is not None:  # found by QA: it was silently ignored
            raise ValueError(
                f"model {loaded.name!r} keeps no KV cache, so it has no use for "
                "--kv-cache-memory (LLaDA and Dream keep one with --kv-cache prefix); omit the flag"
            )
        return 0
    most = config.max_running_requests * longest
    slots = ModelRunner.pool_slots(loaded.model, loaded.device, config.kv_cache_memory, most)
    # The smallest request (one prompt token, one answer token, the decoding's scratch): a
    # pool that cannot hold it would start healthy and refuse every request (found by QA).
    smallest = algorithm.kv_tokens(1, DecodingParams(gen_length=1))
    if slots < smallest:
        raise ValueError(
            f"--kv-cache-memory leaves room for {slots} KV slots, fewer than the smallest "
            f"request needs ({smallest}: one prompt token, one answer token and the decoding's "
            "scratch)"
        )
    return slots


@dataclass(frozen=True, slots=True)
class KVBudget:
    """What requests reserve in ``pool`` (None: nothing is reserved)."""

    pool: KVPool | None
    algorithm: DecodingAlgorithm

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pool held by running requests (0 when idle or without a pool); read
        from other threads (metrics scrape): one integer read under the GIL."""
        if self.pool is None:
            return 0
        return self.pool.used * (self.pool.nbytes // self.pool.slots)

    def need(self, prompt_tokens: int, params: DecodingParams) -> int:
        """Slots a request reserves when it starts (0 without a pool)."""
        if self.pool is None:
            return 0
        return self.algorithm.kv_tokens(prompt_tokens, params)

    def check(self, prompt_tokens: int, params: DecodingParams) -> None:
        """Raise :class:`KVCapacityError` for a request the whole pool cannot hold."""
        need = self.need(prompt_tokens, params)
        if self.pool is not None and need > self.pool.slots:
            raise KVCapacityError(
                f"the request needs {need} KV-cache slots (its prompt, max tokens and decoding "
                f"scratch), but the KV cache holds {self.pool.slots}"
            )

    def startable(self, queue: Sequence[Request]) -> int:
        """How many of ``queue``, in order, the free pool can hold (free-slot count only: a
        fragmented pool may start fewer, which the admission pass then finds)."""
        if self.pool is None:
            return len(queue)
        room, starting = self.pool.free_slots, 0
        for request in queue:
            room -= self.need(len(request.prompt_ids), request.params)
            if room < 0:
                break
            starting += 1
        return starting
