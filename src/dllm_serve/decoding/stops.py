"""A request's stop ids: the rule every decoder's ``init_state`` applies."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_serve.decoding.params import DecodingParams

__all__ = ["request_stop_ids"]


def request_stop_ids(
    mask_id: int, model_stop_ids: Sequence[int], params: DecodingParams
) -> tuple[int, ...]:
    """The ids that end this request's answer: none with ``ignore_eos`` (the whole budget is
    decoded), else the model's plus ``params.stop_token_ids``. Raises ValueError when the
    request names the mask id as a stop id (every masked position would read as a stop)."""
    if mask_id in params.stop_token_ids:
        raise ValueError("the mask id cannot be a stop id")
    return () if params.ignore_eos else (*model_stop_ids, *params.stop_token_ids)
