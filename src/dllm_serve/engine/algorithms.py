"""The one place that picks a checkpoint's decoding algorithm and its KV needs."""

from __future__ import annotations

from collections.abc import Callable

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.algorithm import DecodingAlgorithm
from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.fast_dllm import FastDLLMDecoder
from dllm_serve.decoding.isd import ISDecoder
from dllm_serve.engine.tiers import ISD_FAMILIES, BlockSizeTiers
from dllm_serve.models.families import FastDLLMFamily
from dllm_serve.models.loader import LoadedModel


def algorithm_for(
    loaded: LoadedModel, config: EngineConfig, running: Callable[[], int]
) -> DecodingAlgorithm:
    """Block-diffusion checkpoints (SDAR, LLaDA2; Fast-dLLM v2 with its token shift and
    sub-blocks) decode block by block against an exact KV cache;
    I-DLM checkpoints by exact self-speculation (stride per tiers, docs/isd.md); every other
    family by LLaDA-style block denoising (prefix cache per ``--kv-cache``).

    ``running`` returns the engine's current number of running requests; with tiers the ISD
    decoder asks it at every ``prepare``, so the stride follows the load.
    """
    if loaded.family.block_diffusion:
        assert loaded.block_size is not None  # the loader reads it for these families
        if isinstance(loaded.family, FastDLLMFamily):
            return FastDLLMDecoder(
                loaded.mask_id,
                loaded.stop_ids,
                loaded.block_size,
                sub_block=loaded.family.sub_block_size,
            )
        return BlockDiffusionDecoder(loaded.mask_id, loaded.stop_ids, loaded.block_size)
    if loaded.family.name in ISD_FAMILIES:
        tiers = BlockSizeTiers(config.isd_stride, tuple(config.block_size_tiers))
        return ISDecoder(
            loaded.mask_id,
            loaded.stop_ids,
            stride=config.isd_stride,
            stride_for=(lambda: tiers.stride_for(running())) if tiers.tiers else None,
            max_stride=tiers.max_stride,
        )
    return LLaDADenoiser(
        loaded.mask_id,
        loaded.stop_ids,
        logit_shift=loaded.family.logit_shift,
        bidirectional=loaded.family.bidirectional,
        prefix_cache=config.kv_cache == "prefix",
    )
