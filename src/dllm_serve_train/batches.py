"""The endless, seeded stream of training batches (optionally built by DataLoader workers)."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import torch

from dllm_serve.models.loader import LoadedModel
from dllm_serve_train.objectives import (
    ConsistencyPair,
    TrainBatch,
    by_length,
    consistency_pair,
    idlm_batch,
    llada_batch,
    llada_tail_batch,
)
from dllm_serve_train.tasks import examples
from dllm_serve_train.trimode_objective import trimode_batch


class BatchStream(torch.utils.data.IterableDataset):
    """Batches of ``batch_size`` training examples for ``family``'s objective.

    In the main process the stream is seeded with ``seed`` (the single-process run). Under a
    DataLoader with workers, worker ``i`` draws from its own stream seeded ``seed·1000+1+i``,
    so a run is reproducible for a given worker count (batches arrive in worker order).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        family: str,
        seed: int,
        batch_size: int,
        weights: dict[str, int],
        canvas: int,
        weighting: str = "token_mean",
        addition_operands: str = "uniform",
        ramp_examples: int = 0,
        causal_batches: int = 0,
        ar_fraction: float = 0.0,
        tail_rows: int = 0,
        tail_min_canvas: int = 0,
        phrasing: float = 0.0,
        context: float = 0.0,
        composed: float = 0.0,
        unfamiliar_verbs: float = 0.0,
        consistency: float = 0.0,
    ) -> None:
        self.loaded, self.seed, self.batch_size, self.weights = loaded, seed, batch_size, weights
        self.addition_operands, self.ramp_examples = addition_operands, ramp_examples
        # tasks.examples: how people ask
        self.phrasing, self.context, self.composed = phrasing, context, composed
        self.unfamiliar_verbs = unfamiliar_verbs
        # The weight of the consistency term (objectives.ConsistencyPair) over up to a quarter
        # of each batch's rows with a context: each is also built alone, an extra forward.
        self.consistency = consistency
        self.causal_batches = causal_batches  # LLaDA: the first batches with a causal mask
        self.llada = family == "llada"
        # LLaDA: rows at long canvases (llada_tail_batch), their own batch beside each one
        self.tail_rows, self.tail_min_canvas = tail_rows, tail_min_canvas
        if self.llada:
            self.make = functools.partial(
                llada_batch, canvas=canvas, weighting=weighting, ar_fraction=ar_fraction
            )
        elif family == "nemotron":  # the joint AR + block-diffusion objective of the release
            config = loaded.config
            self.make = functools.partial(
                trimode_batch,
                block_size=int(config["block_size"]),
                ar_weight=float(config.get("ar_loss_weight") or 1.0),
                dlm_weight=float(config.get("dlm_loss_weight") or 1.0),
            )
        else:
            self.make = functools.partial(idlm_batch, ar_fraction=ar_fraction)

    def __iter__(self) -> Iterator[TrainBatch | tuple[TrainBatch | ConsistencyPair, ...]]:
        info = torch.utils.data.get_worker_info()
        seed = self.seed if info is None else self.seed * 1000 + 1 + info.id
        rng = random.Random(seed)
        # Each worker builds 1/num_workers of the batches: its own ramp is as much shorter.
        ramp = self.ramp_examples // (1 if info is None else info.num_workers)
        stream = examples(
            seed,
            "train",
            weights=self.weights,
            addition_operands=self.addition_operands,
            ramp_examples=max(ramp, 1),
            phrasing=self.phrasing,
            context=self.context,
            composed=self.composed,
            unfamiliar_verbs=self.unfamiliar_verbs,
        )
        causal = self.causal_batches // (1 if info is None else info.num_workers)
        made = 0
        while True:
            batch = [next(stream) for _ in range(self.batch_size)]
            kwargs = {"causal": made < causal} if self.llada else {}
            built = self.make(self.loaded, batch, rng, **kwargs)
            # Rows with earlier turns are long: short and long rows then go in batches of
            # their own (the same loss, a fraction of the padding).
            parts: tuple[TrainBatch | ConsistencyPair, ...] = (
                by_length(built) if self.context else (built,)
            )
            asked_after = [ex for ex in batch if ex.context][: self.batch_size // 4]
            if self.consistency and asked_after:
                make = functools.partial(self.make, self.loaded, **kwargs)
                parts += (consistency_pair(make, asked_after, rng, self.consistency),)
            if self.llada and self.tail_rows:
                tail = [next(stream) for _ in range(self.tail_rows)]
                parts += (
                    llada_tail_batch(self.loaded, tail, rng, min_canvas=self.tail_min_canvas),
                )
            yield parts if len(parts) > 1 else parts[0]
            made += 1


def batch_iterator(
    dataset: BatchStream, workers: int
) -> Iterator[TrainBatch | tuple[TrainBatch | ConsistencyPair, ...]]:
    """The dataset itself, or a DataLoader over it with ``workers`` processes. Start it before
    the model moves to a GPU: the workers fork and must not inherit a CUDA context."""
    if workers <= 0:
        return iter(dataset)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, prefetch_factor=4, persistent_workers=True
    )
    return iter(loader)
