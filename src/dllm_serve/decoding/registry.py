"""The one place that maps a checkpoint (its family) and a decoding mode to the algorithm that
decodes it: adding a decoding algorithm is one module plus one line here.

==================================  ============================================================
family                              algorithm
==================================  ============================================================
LLaDA, Dream, LLaDA-MoE (canvas)    :class:`~dllm_serve.decoding.canvas.LLaDADenoiser`
SDAR/TraDo, LLaDA2.x (blocks)       :class:`~.block_diffusion.BlockDiffusionDecoder`
Fast-dLLM v2                        :class:`~dllm_serve.decoding.fast_dllm.FastDLLMDecoder`
I-DLM                               :class:`~dllm_serve.decoding.selfspec.ISDecoder`
tri-mode (Nemotron-Labs-Diffusion)  :class:`TriModeDecoder` over ``ar`` (ISD at stride 1),
                                    ``diffusion`` (``CausalBlockDiffusionDecoder``) and
                                    ``linear_spec`` (``LinearSpecDecoder``)
==================================  ============================================================

**Tri-mode.**
Nemotron-Labs-Diffusion runs one set of weights three ways (``params.py``):
``ar`` (causal decoding with the KV cache: I-DLM's exact decoder at stride 1, which is plain
greedy/sampled AR), ``diffusion`` (``causal_blocks.py``) and ``linear_spec``
(``linear_spec.py``). :class:`TriModeDecoder` routes every call to the request's mode, so rows
of different modes share one forward: each row carries its own attention kind, positions,
KV span and weight view, and the samplers are per row. A request's state records its resolved
mode in ``state.params.decoding_mode``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.causal_blocks import CausalBlockDiffusionDecoder
from dllm_serve.decoding.fast_dllm import FastDLLMDecoder
from dllm_serve.decoding.grammar import TokenGrammar
from dllm_serve.decoding.linear_spec import LinearSpecDecoder
from dllm_serve.decoding.params import (
    AR,
    DECODING_ALGORITHMS,
    DEFAULT_ISD_STRIDE,
    DEFAULT_TRI_MODE,
    DIFFUSION,
    EDITING_ALGORITHMS,
    LINEAR_SPEC,
    TRI_MODE,
    TRI_MODES,
    BlockSizeTiers,
    DecodingParams,
    model_mode,
)
from dllm_serve.decoding.protocol import (
    DecodeState,
    DecodingAlgorithm,
    PrefixReuse,
    RowSpec,
    ShardedLogits,
    StepLogits,
    StepResult,
    as_step_logits,
)
from dllm_serve.decoding.renoise import RenoiseDecoder, renoise_settings
from dllm_serve.decoding.sampler import select_rows
from dllm_serve.decoding.selfspec import ISDecoder
from dllm_serve.models.attention import to_device
from dllm_serve.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaModel
from dllm_serve.models.families import DiffusionGemmaFamily, FastDLLMFamily
from dllm_serve.models.loader import LoadedModel

ISD_FAMILIES = ("sdar",)  # families served by self-speculation (I-DLM)


class DecodingFlags(Protocol):
    """The server's decoding flags the registry reads (the engine's ``EngineConfig``)."""

    decoding_mode: str | None
    decoding_algorithm: str | None
    isd_stride: int
    block_size_tiers: tuple[tuple[int, int], ...]
    kv_cache: str


def algorithm_for(
    loaded: LoadedModel, config: DecodingFlags, running: Callable[[], int]
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
    _check_decoding_algorithm(loaded.name, algorithm, decoding_algorithm(loaded, config))
    # Structured output: one grammar compiler (the model's own tokenizer, a cache of compiled
    # schemas) shared by every mode that enforces it. Under tensor parallelism too: the
    # matchers live on rank 0, whose sampler gathers the constrained rows' logits whole.
    vocab = loaded.vocab_size or len(loaded.tokenizer)
    # Its own copy of the tokenizer: it is read on the engine thread (at the first
    # constrained admission) while the API's threads tokenize with theirs.
    grammar = TokenGrammar(copy.deepcopy(loaded.tokenizer), vocab, loaded.stop_ids)
    for mode in _modes(algorithm).values():
        if type(mode) in STRUCTURED_DECODERS:
            mode.grammar = grammar  # type: ignore[attr-defined]
    return algorithm


def decoding_algorithm(loaded: LoadedModel, config: DecodingFlags) -> str:
    """The commit-rule preset of requests that choose none: ``--decoding-algorithm``, else the
    checkpoint's ``generation_config.json`` ``decoding_algorithm`` (so an editing checkpoint
    can ship LLaDA2.1's S or Q mode as its default), else ``low_confidence``."""
    if config.decoding_algorithm is not None:
        return config.decoding_algorithm
    preset = loaded.generation.get("decoding_algorithm", "low_confidence")
    if preset not in DECODING_ALGORITHMS:
        raise ValueError(
            f"generation_config.json of {loaded.name!r}: decoding_algorithm {preset!r} is not one "
            f"of {', '.join(DECODING_ALGORITHMS)}"
        )
    return preset


def _modes(algorithm: DecodingAlgorithm) -> dict[str, DecodingAlgorithm]:
    """Request mode → the algorithm that decodes it (one entry for a single-mode model)."""
    if isinstance(algorithm, TriModeDecoder):
        return dict(algorithm.modes)
    return {model_mode(algorithm.decoding_mode): algorithm}


def _check_decoding_algorithm(name: str, algorithm: DecodingAlgorithm, preset: str) -> None:
    """A ``--decoding-algorithm`` the model cannot decode by is a ValueError at start-up."""
    if preset == "low_confidence":
        return
    if algorithm.decoding_mode == "self_speculation":
        raise ValueError(
            f"--decoding-algorithm {preset}: model {name!r} (I-DLM) decodes by exact "
            "self-speculation and has no commit rule; omit the flag"
        )
    if algorithm.decoding_mode == "renoise":
        raise ValueError(
            f"--decoding-algorithm {preset}: model {name!r} (DiffusionGemma) decodes by its own "
            "entropy-bounded renoise sampler; omit the flag (its bound: entropy_bound per request)"
        )
    if preset in EDITING_ALGORITHMS and not supports_editing(algorithm):
        raise ValueError(
            f"--decoding-algorithm {preset}: token editing applies to LLaDA2.x checkpoints; "
            f"model {name!r} was not trained to edit tokens"
        )


# The algorithm kinds, as the start-up errors name them.
_KIND_NAMES = {
    "diffusion": "canvas-denoising",
    "block_diffusion": "block-diffusion",
    "self_speculation": "I-DLM",
    TRI_MODE: "tri-mode",
    "renoise": "renoise (DiffusionGemma)",
}


def _check_flags_apply(name: str, kind: str, config: DecodingFlags) -> None:
    """A decoding flag set for a model whose algorithm (of ``kind``) has no use for it is a
    ValueError at start-up (as a wrong ``--decoding-mode`` is), never a setting that silently
    does nothing."""
    unused = []
    if config.isd_stride != DEFAULT_ISD_STRIDE and kind != "self_speculation":
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
    loaded: LoadedModel, config: DecodingFlags, running: Callable[[], int]
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
    loaded: LoadedModel, config: DecodingFlags, running: Callable[[], int]
) -> DecodingAlgorithm:
    if isinstance(loaded.family, DiffusionGemmaFamily):
        return renoise_decoder(loaded)
    if loaded.family.block_diffusion:
        assert loaded.block_size is not None  # the loader reads it for these families
        if isinstance(loaded.family, FastDLLMFamily):
            return FastDLLMDecoder(
                loaded.mask_id,
                loaded.stop_ids,
                loaded.block_size,
                sub_block=loaded.family.sub_block_size,
            )
        return BlockDiffusionDecoder(
            loaded.mask_id,
            loaded.stop_ids,
            loaded.block_size,
            editing=loaded.family.token_editing,
            edit_tokens=loaded.edit_token_ids,
        )
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


def renoise_decoder(loaded: LoadedModel) -> RenoiseDecoder:
    """DiffusionGemma's entropy-bounded renoise sampler, with the checkpoint's canvas and its
    generation_config.json sampler settings (``decoding/renoise.py``)."""
    model = loaded.model
    assert isinstance(model, DiffusionGemmaModel)
    tcfg = model.config
    assert isinstance(tcfg, DiffusionGemmaConfig)
    return RenoiseDecoder(
        loaded.stop_ids,
        canvas_length=tcfg.canvas_length,
        # The whole vocabulary: under tensor parallelism the model's config is this rank's.
        vocab_size=loaded.vocab_size or tcfg.vocab_size,
        settings=renoise_settings(loaded.generation),
        soft_embedding=model.soft_embedding,
        embedding_dtype=model.embed_tokens.weight.dtype,
        mask_id=loaded.mask_id,
        soft_scale=model.soft_scale,
    )


def default_mode(algorithm: DecodingAlgorithm) -> str:
    """The ``decoding_mode`` a request that names none decodes by."""
    if isinstance(algorithm, TriModeDecoder):
        return algorithm.default
    return model_mode(algorithm.decoding_mode)


def check_request(algorithm: DecodingAlgorithm, model: str, params: DecodingParams) -> None:
    """A request setting what ``algorithm`` does not do is a ValueError when it is submitted:
    a ``decoding_mode`` the model lacks must neither decode by another mode nor fail inside
    the engine thread, and only canvas denoising drops canvas positions past an
    ``answer_limit``."""
    tri = isinstance(algorithm, TriModeDecoder)
    modes = tuple(algorithm.modes) if tri else (default_mode(algorithm),)
    if params.decoding_mode not in (None, *modes):
        raise ValueError(
            f"decoding_mode {params.decoding_mode!r}: model {model!r} decodes only by "
            + " or ".join(map(repr, modes))
        )
    if params.mode == "joint_threshold" and not supports_editing(algorithm):
        raise ValueError(
            f"edit_threshold (token editing) applies to LLaDA2.x checkpoints; model {model!r} "
            "was not trained to edit tokens"
        )
    if params.mode == "joint_threshold" and supports_insert_delete(algorithm):
        check_insert_delete(model, params)
    if params.logprobs is not None and not supports_logprobs(algorithm, params.decoding_mode):
        raise ValueError(
            f"logprobs are not recorded for model {model!r} decoding by "
            f"{params.decoding_mode or algorithm.decoding_mode} (a seeded block decoder or "
            "DiffusionGemma's renoise canvases)"
        )
    if params.suffix_ids and not supports_infilling(algorithm):
        raise ValueError(
            f"a suffix (infilling) needs a model whose canvas attends to the text after it; "
            f"model {model!r} reads its prompt causally"
        )
    if params.grammar is not None:
        check_structured(algorithm, model, params)
    if params.answer_limit is not None and algorithm.decoding_mode != "diffusion":
        raise ValueError(f"answer_limit applies to canvas denoising, not {algorithm.decoding_mode}")


LOGPROB_ALGORITHMS = (LLaDADenoiser, BlockDiffusionDecoder, ISDecoder, LinearSpecDecoder)


def supports_logprobs(algorithm: DecodingAlgorithm, mode: str | None = None) -> bool:
    """Whether logprobs are recorded for ``algorithm`` (a tri-mode model's: for ``mode``,
    its default when None; engine/logprobs.py): canvas denoising, block diffusion and
    self-speculation. The seeded block decoders (Fast-dLLM v2, a tri-mode model's
    ``diffusion``) place a seed beside the committed tokens and DiffusionGemma re-draws whole
    canvases: not recorded."""
    if isinstance(algorithm, TriModeDecoder):
        chosen = algorithm.modes[mode or algorithm.default]
        return type(chosen) in LOGPROB_ALGORITHMS
    return type(algorithm) in LOGPROB_ALGORITHMS


def logprob_modes(algorithm: DecodingAlgorithm) -> tuple[str, ...]:
    """The request modes (``decoding_mode``) whose logprobs are recorded."""
    if isinstance(algorithm, TriModeDecoder):
        return tuple(m for m in algorithm.modes if supports_logprobs(algorithm, m))
    return (default_mode(algorithm),) if supports_logprobs(algorithm) else ()


# The decoders that enforce response_format (structured output; decoding/grammar.py): those
# whose answer grows as a left-to-right run per step: canvas denoising and block diffusion,
# seeded ones included (Fast-dLLM v2, tri-mode diffusion: blocks.BlockDecoder.sample and
# _sample_seeded), and the causal verify of self-speculation (ISD, tri-mode ar and
# linear_spec: selfspec.constrain_verify_rows), and DiffusionGemma's renoise sampler, whose
# emitted canvases are projected onto the grammar left to right (renoise._grammar_canvas).
# Under tensor parallelism the first six gather their constrained rows' logits whole
# (sampler.sample_split); DiffusionGemma does not load under tensor parallelism.
STRUCTURED_DECODERS = (
    LLaDADenoiser,
    BlockDiffusionDecoder,
    FastDLLMDecoder,
    CausalBlockDiffusionDecoder,
    ISDecoder,
    LinearSpecDecoder,
    RenoiseDecoder,
)


def structured_output_refusals(algorithm: DecodingAlgorithm) -> dict[str, str]:
    """Request mode → why ``response_format`` is refused there, for the modes that do not
    enforce it (empty: every mode does)."""
    refusals = {}
    for mode, decoder in _modes(algorithm).items():
        if getattr(decoder, "grammar", None) is None:
            refusals[mode] = (
                f"decoding_mode {mode!r} ({type(decoder).__name__}) does not apply a grammar"
            )
    return refusals


def check_structured(algorithm: DecodingAlgorithm, model: str, params: DecodingParams) -> None:
    """A ``response_format`` the decoder cannot enforce is a ValueError (never free text)."""
    mode = (
        algorithm.mode_of(params)
        if isinstance(algorithm, TriModeDecoder)
        else default_mode(algorithm)
    )
    why = structured_output_refusals(algorithm).get(mode)
    if why is not None:
        raise ValueError(f"response_format on model {model!r}: {why}")
    if params.mode == "joint_threshold":
        raise ValueError("response_format cannot be combined with token editing (edit_threshold)")


def supports_infilling(algorithm: DecodingAlgorithm) -> bool:
    """Whether ``algorithm`` can decode a canvas between a prompt and a suffix: canvas
    denoising with bidirectional attention (LLaDA, Dream, LLaDA-MoE), where every canvas
    position sees the suffix. Causal and block-causal models read left to right only."""
    return isinstance(algorithm, LLaDADenoiser) and algorithm.bidirectional


def supports_editing(algorithm: DecodingAlgorithm) -> bool:
    """Whether requests may ask ``algorithm`` for token editing (JointThreshold)."""
    return bool(getattr(algorithm, "editing", False))


def supports_insert_delete(algorithm: DecodingAlgorithm) -> bool:
    """Whether ``algorithm``'s token editing is LLaDA2.2's insert/delete rule
    (JointThresholdInDel: the checkpoint declares DELETE and SPLIT edit tokens)."""
    return getattr(algorithm, "edit_tokens", None) is not None


def insert_delete_refusal(temperature: float, logprobs: bool) -> str | None:
    """Why an editing request cannot decode by JointThresholdInDel (None: it can). The rule is
    greedy, as SGLang's (its cleanup round and anti-loop redraw are argmaxes), and DELETE and
    SPLIT move tokens between positions, so a per-position logprob would not follow its token."""
    if temperature > 0:
        return (
            "insert/delete editing (LLaDA2.2's JointThresholdInDel) is greedy: temperature "
            "must be 0"
        )
    if logprobs:
        return (
            "logprobs are not recorded under insert/delete editing (LLaDA2.2): DELETE and "
            "SPLIT move tokens between positions"
        )
    return None


def check_insert_delete(model: str, params: DecodingParams) -> None:
    """An editing request on an insert/delete model that the rule cannot serve: ValueError."""
    why = insert_delete_refusal(params.temperature, params.logprobs is not None)
    if why is not None:
        raise ValueError(f"model {model!r}: {why}")


# ---- tri-mode ----------------------------------------------------------------------------------


class TriModeDecoder:
    """Dispatches to one algorithm per mode (``modes``); ``default`` serves requests that name
    none (the server's ``--decoding-mode``)."""

    decoding_mode = TRI_MODE

    def __init__(self, modes: Mapping[str, DecodingAlgorithm], default: str) -> None:
        if set(modes) != set(TRI_MODES):
            raise ValueError(f"a tri-mode decoder needs the modes {TRI_MODES}, got {set(modes)}")
        if default not in modes:
            raise ValueError(f"default decoding mode {default!r} is not one of {TRI_MODES}")
        self.modes = dict(modes)
        self.default = default

    def mode_of(self, params: DecodingParams) -> str:
        mode = params.decoding_mode or self.default
        if mode not in self.modes:
            raise ValueError(f"decoding_mode {mode!r} is not one of this model's {TRI_MODES}")
        return mode

    def _algorithm(self, state: Any) -> DecodingAlgorithm:
        return self.modes[state.params.decoding_mode]

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DecodeState:
        resolved = dataclasses.replace(params, decoding_mode=self.mode_of(params))
        return self.modes[resolved.decoding_mode].init_state(prompt_ids, resolved, device)

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """The widest mode's need (a few slots more than ``ar`` needs): what the KV pool is
        sized for, whatever mode the requests pick."""
        return max(m.kv_tokens(prompt_len, params) for m in self.modes.values())

    # Prefix reuse (protocol.PrefixReuse): every mode keeps causal K/V.
    prefix_alignment = 1

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        algorithm = self.modes[self.mode_of(params)]
        assert isinstance(algorithm, PrefixReuse)
        return algorithm.prefix_limit(prompt_len, params)

    def reuse_prefix(self, state: DecodeState, tokens: int) -> None:
        algorithm = self._algorithm(state)
        assert isinstance(algorithm, PrefixReuse)
        algorithm.reuse_prefix(state, tokens)

    def prepare(self, state: DecodeState) -> RowSpec:
        return self._algorithm(state).prepare(state)

    def sample(
        self, states: Sequence[DecodeState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """Each mode's sampler on its own rows; their outputs side by side, ``[R, W]`` (rows
        narrower than ``W`` are padded with zeros, which no commit reads)."""
        logits = as_step_logits(logits)
        groups: dict[str, list[int]] = {}
        for r, state in enumerate(states):
            groups.setdefault(state.params.decoding_mode, []).append(r)  # type: ignore[arg-type]
        if len(groups) == 1:
            return self.modes[next(iter(groups))].sample(states, logits)
        parts = []
        for mode, rows in groups.items():
            index = to_device(rows, logits.device)
            sub = self.modes[mode].sample([states[r] for r in rows], select_rows(logits, rows))
            parts.append((index, sub))
        width = max(sub.shape[1] for _, sub in parts)
        out = torch.zeros(len(states), width, dtype=torch.long, device=logits.device)
        for index, sub in parts:
            out[index, : sub.shape[1]] = sub.to(torch.long)
        return out

    def commit(
        self, states: Sequence[DecodeState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [
            self._algorithm(s).commit([s], [row])[0] for s, row in zip(states, host, strict=True)
        ]
