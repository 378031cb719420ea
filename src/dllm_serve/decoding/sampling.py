"""Token proposals: greedy argmax or an exact float64 Gumbel-max sample."""

from __future__ import annotations

import torch

from dllm_serve.decoding.params import DecodingParams

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit


def new_generator(params: DecodingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator on ``device`` (None at temperature 0, which draws nothing).

    Seeded from ``params.seed`` (any int64, negative too, maps onto the unsigned 64-bit seed
    space), else from fresh OS entropy as ``torch.seed()`` does.
    """
    if params.temperature <= 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed % _SEED_MODULUS)
    return generator


def gumbel_argmax(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, V]``: a sample from ``softmax(logits / T)``.

    ``temperature == 0`` is greedy: ``argmax(logits)``, and the generator is not touched.

    Otherwise this is the Gumbel-max trick. LLaDA's ``add_gumbel_noise`` computes
    ``exp(z) / (-log u)^T`` with ``u ~ U(0, 1)`` in float64 and takes the argmax. The log of
    that expression is ``z - T·log(-log u) = z + T·g`` with ``g = -log(-log u) ~ Gumbel(0, 1)``,
    and ``argmax(z + T·g) = argmax(z/T + g)``, which is an exact draw from ``softmax(z/T)``.
    We take the argmax in log space (same argmax, since log is monotone) so that ``exp`` cannot
    overflow for logits above ~709. Float64 matters: low-precision Gumbel noise measurably
    degrades generation quality (arXiv:2409.02908, cited by LLaDA).

    ``u`` is drawn from ``generator`` (the request's own RNG, on the logits' device), never
    from the global RNG, so a request's sample does not depend on what it is batched with.
    ``u == 0`` (possible with ``torch.rand``) gives noise ``-inf``: that entry is never chosen,
    exactly as ``exp(z) / inf = 0`` in the reference.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.to(torch.float64)
    u = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=z.device)
    return (z - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


_DESCENDING: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def argmax_(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximum among ties), computed by destroying ``logits``.

    On CPU the index-returning reduction is an order of magnitude slower than ``amax``; this
    gets the same index from vectorised ops only, in place (no ``[N, V]`` temporaries):
    ``d = z − max z`` is exactly 0 at the maxima and negative elsewhere, ``(sign(d) + 1)·w``
    with ``w_j = V − j`` keeps ``V − j`` at the maxima and 0 elsewhere, and its ``amax`` picks
    the largest ``V − j``, i.e. the smallest maximal ``j``. Exact for ``V ≤ 2^24`` (integers in
    float32). −inf entries (an excluded token) are never chosen unless the row is all −inf.
    """
    vocab = logits.shape[-1]
    key = (vocab, logits.device, logits.dtype)
    weights = _DESCENDING.get(key)
    if weights is None:
        weights = _DESCENDING[key] = torch.arange(
            vocab, 0, -1, dtype=logits.dtype, device=logits.device
        )
    top = logits.amax(dim=-1, keepdim=True)
    signs = logits.sub_(top).sign_()
    marked = torch.addcmul(weights, signs, weights, out=logits)  # (sign + 1)·w, one pass
    return (vocab - marked.amax(dim=-1).long()).clamp_(0, vocab - 1)
