"""Tensor-parallel serving: rank 0 runs the API, the scheduler and the samplers; ranks 1…N−1
are worker processes that only run the forward.

``launch`` starts the workers (``spawn``), joins the ``torch.distributed`` group with them
(gloo on CPU; NCCL for the forward's collectives on CUDA, with a gloo group for control;
``engine/parallel/rendezvous.py``) and loads rank 0's shard. Each step, rank 0's
:class:`~dllm_serve.engine.model_runner.ModelRunner` broadcasts the step's rows (``RowSpec``
objects: tokens, positions, KV spans — a few hundred bytes) on the control group; every rank
builds the same flat batch on its own device and runs its shard of the forward. The logits stay
sharded by vocabulary: rank 0's sampler asks the workers for per-position reductions of their
slices (``engine/parallel/vocab.py``), and gathers whole rows only where a rule needs the whole
distribution. The KV pool's slots are chosen by rank 0's scheduler and travel in the rows, so
every rank's pool (its own KV heads) stays in step without any other message.

A failure of any rank fails the server visibly (``engine/parallel/group.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm_serve.engine.model_runner import INIT, RUN, ModelRunner
from dllm_serve.engine.parallel.group import (
    REDUCE,
    STOP,
    Heartbeat,
    TensorParallelGroup,
    kill_workers,
    store_address,
)
from dllm_serve.engine.parallel.rendezvous import (
    agree,
    device_for,
    free_port,
    join,
    multi_node_rank,
)
from dllm_serve.logs import configure_logging
from dllm_serve.models.checkpoint_files import read_json
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import family_for
from dllm_serve.models.hub import resolve_model_path
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve.models.sharding import shard_config

logger = logging.getLogger(__name__)


def _watch_start_up(workers: list[Any]) -> threading.Event:
    """Until the returned event is set, exit with status 1 at once if a worker ends.

    A worker that dies before it joins the group (a bad environment, an offline script
    without ``if __name__ == "__main__":``, a kill) would otherwise leave rank 0 waiting for
    it in ``init_process_group`` for the rendezvous timeout, ten minutes, silently; the
    group's own watcher (:meth:`TensorParallelGroup.watch`) takes over after.
    """
    joined = threading.Event()

    def run() -> None:
        while not joined.is_set():
            ready = wait([p.sentinel for p in workers], timeout=0.5)
            if not ready or joined.is_set():
                continue
            ended = [(i, p) for i, p in enumerate(workers) if p.sentinel in ready]
            for _, process in ended:
                process.join(timeout=1.0)
            dead = ", ".join(f"rank {i + 1} (exit code {p.exitcode})" for i, p in ended)
            logger.critical(
                "tensor-parallel worker died while the group was starting: %s (its error is "
                'above; an offline script needs `if __name__ == "__main__":` around it); '
                "exiting with status 1",
                dead,
            )
            kill_workers(workers)
            os._exit(1)

    threading.Thread(target=run, name="dllm-tp-start-watch", daemon=True).start()
    return joined


def worker_main(
    rank: int,
    size: int,
    init_method: str,
    model: str,
    device: str,
    dtype: str,
    draft_lora: str | None,
    threads: int,
    expert_parallel: bool = False,
    log: tuple[str, str] | None = ("warning", "text"),
) -> None:
    """A worker rank: load this rank's shard, then run every forward rank 0 announces.

    ``log`` is the server's ``(level, format)``: a spawned worker starts with no logging set
    up, so its lines would otherwise bypass the server's format (None: already set up).
    """
    if log is not None:
        configure_logging(*log)
    if threads:
        torch.set_num_threads(threads)
    dev = device_for(device, rank)
    shard, control = join(rank, size, init_method, dev, expert_parallel)
    heartbeat = Heartbeat(rank, [0], store_address(init_method), _worker_lost).start()
    try:
        agree(model, size, control)
        loaded = load_model(model, device=dev, dtype=dtype, shard=shard)
        if draft_lora is not None:
            attach_draft_lora(loaded.model, draft_lora)
    except Exception as exc:
        dist.destroy_process_group()  # else gloo's threads abort the process at exit
        raise SystemExit(f"dllm-serve (tensor-parallel rank {rank}): {exc}") from None
    runner = None
    logits = None  # this rank's slice of the last step's logits, for the sampler's reductions
    box: list[Any] = [None]
    with torch.inference_mode():
        while True:
            try:
                dist.broadcast_object_list(box, src=0, group=control)
            except Exception:  # rank 0 is gone
                os._exit(1)
            message = box[0]
            if message[0] == STOP:
                heartbeat.stop()
                break
            if message[0] == INIT:
                runner = ModelRunner(
                    loaded.model, loaded.device, kv_slots=message[1], mask_id=message[2],
                    attention=message[3],
                )  # fmt: skip
            elif message[0] == RUN:
                assert runner is not None
                logits = runner.run(message[1], message[2])
            elif message[0] == REDUCE:
                assert runner is not None and logits is not None
                runner.reduce(message[1], logits)
    dist.destroy_process_group()


def _worker_lost(reason: str) -> NoReturn:
    """A worker whose rank 0 is gone (frozen, or its node unreachable) exits at once."""
    logger.critical("%s; exiting with status 1", reason)
    os._exit(1)


def launch(
    model: str,
    device: str,
    dtype: str,
    size: int,
    draft_lora: str | None = None,
    threads: int = 0,
    expert_parallel: bool = False,
    log: tuple[str, str] = ("warning", "text"),
) -> LoadedModel:
    """Start ``size − 1`` workers and load rank 0's shard; the returned model's ``parallel``
    is the :class:`TensorParallelGroup` its ModelRunner drives. ``draft_lora`` is attached
    by the workers; the caller attaches it to rank 0's model (after its own checks)."""
    if size < 2:
        raise ValueError("a tensor-parallel group needs at least 2 ranks")
    # Refuse a model that does not shard before any process starts (a clear error, once).
    config = read_json(resolve_model_path(model) / "config.json")
    shard_config(family_for(config).transformer_config(config), size, 0, expert_parallel)
    if device_for(device, 0).startswith("cuda") and torch.cuda.device_count() < size:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} needs {size} GPUs, {torch.cuda.device_count()} seen"
        )
    if multi_node_rank(size) is not None:
        # Every rank was started by a launcher (this is rank 0): join through the environment.
        init_method, workers = "env://", []
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        workers = [
            ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    size,
                    init_method,
                    model,
                    device,
                    dtype,
                    draft_lora,
                    threads,
                    expert_parallel,
                    log,
                ),
                name=f"dllm-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in workers:
            p.start()
    dev = device_for(device, 0)
    joined = _watch_start_up(workers) if workers else None
    try:
        shard, control = join(0, size, init_method, dev, expert_parallel)
    except BaseException:
        kill_workers(workers)  # they would wait for rank 0 in vain
        raise
    group = TensorParallelGroup(shard, control, workers)
    if workers:
        group.watch()
    if joined is not None:
        joined.set()
    address = store_address(init_method)
    group.heartbeat = Heartbeat(0, range(1, size), address, group.lost).start()
    try:
        agree(model, size, control)
        loaded = load_model(model, device=dev, dtype=dtype, shard=shard)
    except BaseException:
        group.stop(timeout=5)  # the workers, then the process group: a clean exit status
        raise
    loaded.parallel = group  # rank 0 attaches a draft LoRA as without parallelism
    return loaded
