"""Checks of a request against the served model, once its prompt is tokenized: token ids in
the vocabulary, no mask token, and prompt plus canvas within the context."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_serve.api.errors import invalid


def check_token_ids(ids: Sequence[int], vocab_size: int, mask_id: int | None, param: str) -> None:
    """Token ids sent by the client must be in the vocabulary and never the mask token."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"Invalid value for '{param}[{i}]': token id {token} is outside the model's "
                f"vocabulary (0 to {vocab_size - 1}).",
                f"{param}[{i}]",
            )
        if token == mask_id:
            raise invalid(
                f"Invalid value for '{param}[{i}]': token id {token} is the model's mask token.",
                f"{param}[{i}]",
            )


def check_no_mask_token(ids: Sequence[int], mask_id: int | None, param: str) -> None:
    """A prompt written as text must not tokenize to the mask token either.

    The mask token marks a position for the model to fill in. The server fills the answer
    canvas only, so a mask in the prompt would stay a hole the model reads as noise, where the
    reference loop would fill it; the same token given as an id is refused
    (:func:`check_token_ids`), and so is its text.
    """
    if mask_id is not None and mask_id in ids:
        raise invalid(
            f"Invalid value for '{param}': the text contains the model's mask token (id "
            f"{mask_id}), which marks a position to fill in; only the answer canvas is "
            "filled in, so a prompt may not contain it.",
            param,
        )


def check_context_length(
    prompt_tokens: int,
    gen_length: int,
    max_length: int,
    prompt_param: str = "messages",
    canvas_param: str = "max_tokens",
) -> None:
    """The prompt plus the canvas must fit the model's context; ``canvas_param`` is the field
    that set the canvas (``RequestSpec.canvas_param``)."""
    if prompt_tokens + gen_length > max_length:
        param = prompt_param if prompt_tokens >= max_length else canvas_param
        raise invalid(
            f"This model's maximum context length is {max_length} tokens. However, you "
            f"requested {prompt_tokens + gen_length} tokens ({prompt_tokens} in the "
            f"{prompt_param}, {gen_length} in the completion canvas). Please reduce the length "
            f"of the {prompt_param} or the completion.",
            param,
            code="context_length_exceeded",
        )
