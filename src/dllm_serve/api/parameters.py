"""Fields → :class:`DecodingParams`: ``max_tokens`` and ``target_length`` set the canvas,
``block_length`` and ``num_denoising_steps`` split it, and a long canvas without
``block_length`` is decoded in the model's recommended block; block-diffusion, renoise and
self-speculative requests follow their own mode's rules (:mod:`dllm_serve.api.rules` says
which fields a mode accepts). A combination that cannot be decoded is a 400, never a 500.
"""

from __future__ import annotations

from dataclasses import replace

from dllm_serve.api.errors import invalid
from dllm_serve.api.rules import (
    BLOCK,
    CANVAS,
    RENOISE,
    ModelDecoding,
    Request,
    check_renoise,
    local_leap_settings,
    logprob_count,
    response_format_grammar_of,
)
from dllm_serve.decoding.params import DEFAULT_STEPS, DecodingParams

MAX_STEPS = 512


def decoding_params(
    req: Request,
    default_gen_length: int,
    default_block_length: int | None,
    round_canvas: bool = False,
    rules: str = CANVAS,
    block_size: int | None = None,
    model: ModelDecoding | None = None,
) -> DecodingParams:
    """The request's decoding parameters (a 400 for any field or combination that cannot be).

    ``round_canvas`` (canvas denoising models): a long canvas that the model's block does not
    divide is rounded up to whole blocks and the answer is cut at ``max_tokens``, rather than
    decoded as one block far longer than the model was trained on.

    ``rules`` (the modes above): the canvas rules below apply to :data:`CANVAS`
    requests only. A :data:`BLOCK` request decodes in the model's trained ``block_size``
    whatever ``max_tokens`` is (its decoder rounds the canvas up to whole blocks), and
    ``num_denoising_steps`` is per block, by default one token per step; a
    :data:`NO_CANVAS` request has no steps or blocks at all.
    """
    max_completion_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = max_completion_tokens or req.max_tokens
    if req.max_tokens and max_completion_tokens and req.max_tokens != max_completion_tokens:
        raise invalid(
            "'max_tokens' and 'max_completion_tokens' are the same setting and were given "
            "different values.",
            "max_completion_tokens",
        )
    if req.target_length is not None and max_tokens is not None and max_tokens < req.target_length:
        named = "max_completion_tokens" if max_completion_tokens else "max_tokens"
        raise invalid(
            f"'target_length' ({req.target_length}) sets the canvas length and exceeds "
            f"{named} ({max_tokens}).",
            "target_length",
        )
    gen_length = req.target_length or max_tokens or default_gen_length
    if rules == RENOISE:
        return _renoise_params(req, gen_length, model)
    if rules != CANVAS:
        return _params_without_canvas(req, gen_length, rules, block_size)
    auto_block = answer_limit = None
    if req.block_length is None and default_block_length:
        auto_block = recommended_block(gen_length, default_block_length)
        long = gen_length > default_block_length  # a canvas within one block stays one
        if auto_block is None and long and round_canvas and req.target_length is None:
            # No block of about the model's size divides the canvas (1001, 997, ...): round
            # the canvas up to whole blocks and keep max_tokens as the answer's limit. An
            # explicit target_length is a canvas the client chose, so it is never rounded.
            rounded = round_up_to_blocks(gen_length, default_block_length)
            # Past MAX_STEPS blocks it stays one block, as recommended_block leaves it (and a
            # canvas that long is refused by the context check of nearly every model).
            if gen_length < rounded <= MAX_STEPS * default_block_length:
                gen_length, answer_limit = rounded, gen_length
                auto_block = default_block_length
    block_length = req.block_length or auto_block or gen_length
    if block_length > gen_length or gen_length % block_length:
        raise invalid(
            f"'block_length' ({block_length}) must divide the canvas length ({gen_length}).",
            "block_length",
        )
    num_blocks = gen_length // block_length
    if num_blocks > MAX_STEPS:
        raise invalid(
            f"The canvas of {gen_length} tokens has {num_blocks} blocks of {block_length}; at "
            f"most {MAX_STEPS} blocks are allowed (each block needs a denoising step).",
            "block_length",
        )
    if req.num_denoising_steps is None and auto_block is not None:
        # The server chose the blocks: each gets the steps a one-block canvas of that size
        # would get (one token per step for the demo models), so quality does not depend on
        # how long a canvas the client asked for.
        steps = num_blocks * min(DEFAULT_STEPS, block_length)
    elif req.num_denoising_steps is None:
        # Default 128 capped at the canvas, rounded down to a multiple of the block count.
        steps = max(num_blocks, min(DEFAULT_STEPS, gen_length) // num_blocks * num_blocks)
    else:
        steps = req.num_denoising_steps
        if steps % num_blocks:
            # A block the server chose is named as such, not as a block_length the client
            # never sent.
            chosen = (
                ", the block the server chose for this canvas; send block_length to choose another"
                if auto_block is not None and req.block_length is None
                else ""
            )
            raise invalid(
                f"'num_denoising_steps' ({steps}) must be a multiple of the number of blocks "
                f"({num_blocks} = canvas {gen_length} / block_length {block_length}{chosen}).",
                "num_denoising_steps",
            )
    try:
        params = _build_params(req, gen_length, steps, block_length, _temperature(req))
        return params if answer_limit is None else replace(params, answer_limit=answer_limit)
    except ValueError as exc:  # a combination the checks above missed: still a 400, never a 500
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _params_without_canvas(
    req: Request, gen_length: int, rules: str, block_size: int | None
) -> DecodingParams:
    """A block-diffusion or non-denoising request: ``gen_length`` is the answer budget; the
    params' one block is a formality (the decoders use the model's block, or none)."""
    if rules == BLOCK:
        assert block_size is not None  # every block-diffusion model has its trained block
        # Per block; one token per step by default, however short max_tokens is.
        steps = req.num_denoising_steps or block_size
    else:
        steps = min(DEFAULT_STEPS, gen_length)  # unused: nothing is denoised
    try:
        return _build_params(req, gen_length, steps, None, _temperature(req))
    except ValueError as exc:
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _renoise_params(req: Request, answer_limit: int, model: ModelDecoding | None) -> DecodingParams:
    """A DiffusionGemma request: ``max_tokens`` limits the answer across canvases, each canvas
    gets ``num_denoising_steps`` (at most, and by default, the checkpoint's
    ``max_denoising_steps``), ``entropy_bound`` overrides the checkpoint's bound. The sampler's
    temperature is the checkpoint's per-step schedule, so a request temperature is a 400."""
    assert model is not None and model.max_denoising_steps is not None
    most = model.max_denoising_steps
    if req.target_length is not None:
        check_renoise(["target_length"], model)
    for name, set_ in (("temperature", req.temperature is not None), ("top_k", req.top_k == 1)):
        if set_:
            raise invalid(
                f"'{name}' does not apply to this model: DiffusionGemma samples every "
                "denoising step at the checkpoint's temperature schedule (t_max 0.8 on the "
                "first step down to t_min 0.4 on the last, generation_config.json), and the "
                "answer is the argmax of the last step. Omit it; set 'seed' for a "
                "reproducible answer.",
                name,
                code="not_applicable",
            )
    if req.entropy_bound is not None and req.entropy_bound <= 0:
        raise invalid(
            "'entropy_bound' must be > 0 for this model's renoise sampler (as its checkpoint's "
            "generation_config.json requires).",
            "entropy_bound",
        )
    steps = req.num_denoising_steps or most
    if steps > most:
        raise invalid(
            f"'num_denoising_steps' ({steps}) exceeds this model's max_denoising_steps "
            f"({most}, generation_config.json): the temperature schedule and the training "
            "cover at most that many steps per canvas.",
            "num_denoising_steps",
        )
    try:
        return DecodingParams(
            gen_length=answer_limit,
            steps=steps,
            seed=req.seed,
            force_single_batch=bool(req.force_single_batch),
            ignore_eos=bool(req.ignore_eos),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            decoding_mode=req.decoding_mode,
            entropy_bound=req.entropy_bound,
            grammar=response_format_grammar_of(req),
        )
    except ValueError as exc:
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _temperature(req: Request) -> float:
    if req.top_k == 1:
        return 0.0  # top_k=1 asks for the most likely token: greedy decoding
    return 0.0 if req.temperature is None else req.temperature


def round_up_to_blocks(gen_length: int, block: int) -> int:
    """The shortest canvas of whole blocks that holds ``gen_length`` positions."""
    return -(-gen_length // block) * block


def recommended_block(gen_length: int, block: int) -> int | None:
    """The block a long canvas is decoded in when the request names none.

    A canvas longer than the model's recommended block is split into blocks of about that
    size, so an answer that ends with EOS early ends the work one block later: the largest
    divisor of the canvas between half the block and the block. None (one block, the
    contract's default) when the canvas fits in one block or has no such divisor.
    """
    if gen_length <= block:
        return None
    for size in range(block, (block + 1) // 2 - 1, -1):
        if size >= 1 and gen_length % size == 0 and gen_length // size <= MAX_STEPS:
            return size
    return None


def _build_params(
    req: Request,
    gen_length: int,
    steps: int,
    block_length: int | None,
    temperature: float,
) -> DecodingParams:
    return DecodingParams(
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=temperature,
        seed=req.seed,
        block_schedule=req.block_schedule or "uniform",
        confidence_metric=req.confidence_metric or "top1_prob",
        force_single_batch=bool(req.force_single_batch),
        confidence_threshold=req.confidence_threshold,
        use_local_leap=bool(req.use_local_leap),
        entropy_bound=req.entropy_bound,
        entropy_threshold=req.entropy_threshold,
        edit_threshold=req.edit_threshold,
        **(
            {}
            if req.max_post_edit_steps is None
            else {"max_post_edit_steps": req.max_post_edit_steps}
        ),
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=logprob_count(req),
        grammar=response_format_grammar_of(req),
        decoding_mode=req.decoding_mode,
        **local_leap_settings(req),
    )
