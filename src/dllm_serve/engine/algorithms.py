"""The one place that picks a checkpoint's decoding algorithm and its KV needs."""

from __future__ import annotations

from collections.abc import Callable

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.algorithm import DecodingAlgorithm
from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder
from dllm_serve.decoding.causal_diffusion import CausalBlockDiffusionDecoder
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.fast_dllm import FastDLLMDecoder
from dllm_serve.decoding.isd import ISDecoder
from dllm_serve.decoding.linear_spec import LinearSpecDecoder
from dllm_serve.decoding.modes import (
    AR,
    DEFAULT_TRI_MODE,
    DIFFUSION,
    LINEAR_SPEC,
    TRI_MODE,
    model_mode,
)
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.trimode import TriModeDecoder
from dllm_serve.engine.tiers import ISD_FAMILIES, BlockSizeTiers
from dllm_serve.models.families import FastDLLMFamily
from dllm_serve.models.loader import LoadedModel


def algorithm_for(
    loaded: LoadedModel, config: EngineConfig, running: Callable[[], int]
) -> DecodingAlgorithm:
    """Block-diffusion checkpoints (SDAR, LLaDA2; Fast-dLLM v2 with its token shift and
    sub-blocks) decode block by block against an exact KV cache; I-DLM checkpoints by exact
    self-speculation (stride per tiers, docs/self-speculation.md); every other family by
    LLaDA-style block denoising (prefix cache per ``--kv-cache``).

    ``running`` returns the engine's current number of running requests; with tiers the ISD
    decoder asks it at every ``prepare``, so the stride follows the load.

    Tri-mode checkpoints (Nemotron-Labs-Diffusion) decode each request by its own
    ``decoding_mode`` (default ``--decoding-mode``, else linear_spec; docs/self-speculation.md).
    Any other model has one mode, and a ``--decoding-mode`` naming another is a ValueError.
    """
    if loaded.family.tri_mode:
        algorithm: DecodingAlgorithm = _tri_mode(loaded, config, running)
    else:
        algorithm = _one_mode(loaded, config, running)
        own = model_mode(algorithm.decoding_mode)
        if config.decoding_mode not in (None, own):
            raise ValueError(
                f"--decoding-mode {config.decoding_mode}: model {loaded.name!r} decodes only by "
                f"'{own}'; omit the flag or set it to '{own}'"
            )
    _check_flags_apply(loaded.name, algorithm.decoding_mode, config)
    return algorithm


# The algorithm kinds, as the start-up errors name them.
_KIND_NAMES = {
    "diffusion": "canvas-denoising",
    "block_diffusion": "block-diffusion",
    "self_speculation": "I-DLM",
    TRI_MODE: "tri-mode",
}


def _check_flags_apply(name: str, kind: str, config: EngineConfig) -> None:
    """A decoding flag set for a model whose algorithm (of ``kind``) has no use for it is a
    ValueError at start-up (as a wrong ``--decoding-mode`` is), never a setting that silently
    does nothing."""
    unused = []
    if config.isd_stride != EngineConfig().isd_stride and kind != "self_speculation":
        unused.append("--isd-stride (I-DLM models only)")
    if config.block_size_tiers and kind not in ("self_speculation", TRI_MODE):
        unused.append("--block-size-tiers (I-DLM and tri-mode models only)")
    if config.kv_cache != "none" and kind != "diffusion":
        unused.append("--kv-cache (LLaDA and Dream: the others always keep an exact KV cache)")
    if unused:
        raise ValueError(
            f"model {name!r} ({_KIND_NAMES.get(kind, kind)}) has no use for "
            + ", ".join(unused)
            + "; omit the flag"
        )


def _tri_mode(
    loaded: LoadedModel, config: EngineConfig, running: Callable[[], int]
) -> TriModeDecoder:
    """ar, diffusion and linear_spec over the same weights; block-size tiers shrink
    LinearSpec's block B under load (exact for any B)."""
    assert loaded.block_size is not None  # the tri-mode family reads it from config.json
    tiers = BlockSizeTiers(loaded.block_size, tuple(config.block_size_tiers))
    linear = LinearSpecDecoder(
        loaded.mask_id,
        loaded.stop_ids,
        block_size=loaded.block_size,
        block_for=(lambda: tiers.stride_for(running())) if tiers.tiers else None,
        max_block=tiers.max_stride,
    )
    modes = {
        AR: ISDecoder(loaded.mask_id, loaded.stop_ids, stride=1),
        DIFFUSION: CausalBlockDiffusionDecoder(loaded.mask_id, loaded.stop_ids, loaded.block_size),
        LINEAR_SPEC: linear,
    }
    default = config.decoding_mode or DEFAULT_TRI_MODE
    if default not in modes:
        raise ValueError(
            f"--decoding-mode {default}: model {loaded.name!r} is tri-mode and decodes by "
            "'ar', 'diffusion' or 'linear_spec'"
        )
    return TriModeDecoder(modes, default)


def _one_mode(
    loaded: LoadedModel, config: EngineConfig, running: Callable[[], int]
) -> DecodingAlgorithm:
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
        mask_lookahead=loaded.mask_lookahead,
    )


def default_mode(algorithm: DecodingAlgorithm) -> str:
    """The ``decoding_mode`` a request that names none decodes by."""
    if isinstance(algorithm, TriModeDecoder):
        return algorithm.default
    return model_mode(algorithm.decoding_mode)


def check_request(algorithm: DecodingAlgorithm, model: str, params: DecodingParams) -> None:
    """A request setting what ``algorithm`` does not do is a ValueError when it is submitted:
    a ``decoding_mode`` the model lacks must not decode by another mode (found by QA: 'ar' on
    I-DLM ran ISD) nor fail inside the engine thread (a tri-mode model's 'isd'), and only
    canvas denoising drops canvas positions past an ``answer_limit``."""
    tri = isinstance(algorithm, TriModeDecoder)
    modes = tuple(algorithm.modes) if tri else (default_mode(algorithm),)
    if params.decoding_mode not in (None, *modes):
        raise ValueError(
            f"decoding_mode {params.decoding_mode!r}: model {model!r} decodes only by "
            + " or ".join(map(repr, modes))
        )
    if params.answer_limit is not None and algorithm.decoding_mode != "diffusion":
        raise ValueError(f"answer_limit applies to canvas denoising, not {algorithm.decoding_mode}")
