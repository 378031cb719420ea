"""A request's stop ids: the rule every decoder's ``init_state`` applies."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_serve.decoding.params import DecodingParams

__all__ = ["request_stop_ids"]


def request_stop_ids(
    mask_id: int, model_stop_ids: Sequence[int], params: DecodingParams
) -> tuple[int, ...]:
    """The ids that end this request's answer: the model's (EOS, end of turn) plus
    ``params.stop_token_ids``. ``ignore_eos`` drops only the model's, as in vLLM: ids the
    client asked for still end the answer. Raises ValueError when the request names the mask
    id as a stop id (every masked position would read as a stop)."""
    if mask_id in params.stop_token_ids:
        raise ValueError("the mask id cannot be a stop id")
    if params.ignore_eos:
        return tuple(params.stop_token_ids)
    return (*model_stop_ids, *params.stop_token_ids)
