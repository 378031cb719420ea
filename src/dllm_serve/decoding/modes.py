"""The per-request decoding modes a client can name (``decoding_mode``), torch-free.

A tri-mode model (Nemotron-Labs-Diffusion) decodes one set of weights three ways, chosen per
request: ``ar`` (causal, one token per forward), ``diffusion`` (block diffusion over a causal
prefix) and ``linear_spec`` (diffusion draft, causal verify). Every other model has exactly
one mode: ``diffusion`` for the denoising and block-diffusion families, ``isd`` for I-DLM's
introspective strided decoding. The engine names its algorithm's kind (``decoding_mode`` of
``decoding/algorithm.py``); :func:`model_mode` maps that kind to the mode a client may name.
"""

from __future__ import annotations

AR = "ar"
DIFFUSION = "diffusion"
LINEAR_SPEC = "linear_spec"
ISD = "isd"
TRI_MODES = (AR, DIFFUSION, LINEAR_SPEC)
REQUEST_MODES = (AR, DIFFUSION, LINEAR_SPEC, ISD)
DEFAULT_TRI_MODE = LINEAR_SPEC  # exact like ar, fewer forwards per token on a trained model

TRI_MODE = "tri_mode"  # the algorithm kind of a tri-mode model (several modes)
_ONE_MODE = {"diffusion": DIFFUSION, "block_diffusion": DIFFUSION, "self_speculation": ISD}

DESCRIPTIONS = {
    AR: "autoregressive: causal decoding with a KV cache, one token per forward",
    DIFFUSION: "diffusion: masked positions denoised in parallel",
    LINEAR_SPEC: "LinearSpec: a block drafted in the diffusion view, verified causally",
    ISD: "I-DLM introspective strided decoding (exact self-speculation)",
}


def model_mode(kind: str) -> str:
    """The one request mode of a single-mode algorithm kind (``diffusion``, ``isd``)."""
    try:
        return _ONE_MODE[kind]
    except KeyError:
        raise ValueError(f"algorithm kind {kind!r} has no single decoding mode") from None
