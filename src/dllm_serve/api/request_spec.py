"""A validated generation request: what a route hands to the engine, and how its canvas is
fitted to the prompt once the prompt's length is known."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dllm_serve.api.errors import APIError
from dllm_serve.decoding.params import DecodingParams


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A validated chat or text-completion request: what the route hands to the engine.

    Chat requests carry ``messages`` (rendered with the chat template); text completions carry
    ``prompt`` (a string tokenized as is, or token ids).
    """

    messages: list[dict[str, str]] | None
    params: DecodingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    diffusion_fields: tuple[str, ...] = ()  # canvas-denoising fields the client set
    prompt: str | list[int] | None = None
    # Where ``prompt`` sits in the body, for errors naming one of its tokens ("prompt[0]" when
    # the client wrapped it in a one-element list).
    prompt_param: str = "prompt"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    include_stop_str: bool = False  # include_stop_str_in_output
    info: dict[str, Any] = field(default_factory=dict)  # informational fields the client set
    # When ``params`` rounded the canvas up to whole blocks: the same request unrounded (one
    # block of max_tokens), for a prompt that leaves room for max_tokens but not the rounding.
    unrounded: DecodingParams | None = None
    # The field that set the canvas, which a context-length error names.
    canvas_param: str = "max_tokens"
    # (error, rounded canvas length): the client's step count does not fit the rounded canvas's
    # blocks; ``fitted`` raises it when that canvas fits the context, else keeps one block.
    refused_if_rounded: tuple[APIError, int] | None = None

    def fitted(self, prompt_tokens: int, max_length: int) -> RequestSpec:
        """This spec for a prompt of ``prompt_tokens``: a canvas rounded up to whole blocks
        that would overflow the context, while max_tokens itself fits, keeps the whole blocks
        that fit (the answer may then be up to a block shorter than max_tokens, never longer)
        or, when the client set the step count (which fewer blocks would change), falls back
        to one unrounded block. When max_tokens itself does not fit, the unrounded request is
        returned, so the context check refuses the client's own number."""
        if self.refused_if_rounded is not None:
            error, rounded = self.refused_if_rounded
            if prompt_tokens + rounded <= max_length:
                raise error
            return replace(self, refused_if_rounded=None)  # one unrounded block, any steps
        params, unrounded = self.params, self.unrounded
        if unrounded is None or prompt_tokens + params.gen_length <= max_length:
            return self
        block = params.block_length
        assert block is not None  # resolved by DecodingParams
        whole = (max_length - prompt_tokens) // block * block
        fits = prompt_tokens + unrounded.gen_length <= max_length
        if fits and whole >= block and "num_denoising_steps" not in self.diffusion_fields:
            steps = whole // block * params.steps_per_block
            shrunk = replace(params, gen_length=whole, steps=steps, answer_limit=None)
            return replace(self, params=shrunk, unrounded=None)
        return replace(self, params=unrounded, unrounded=None)
