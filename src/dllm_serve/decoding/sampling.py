"""Token proposals: greedy argmax or an exact float64 Gumbel-max sample."""

from __future__ import annotations

import torch

from dllm_serve.decoding.params import DecodingParams

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit


def new_generator(params: DecodingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator on ``device`` (None at temperature 0, which draws nothing).

    Seeded from ``params.seed`` (any int64, negative too, maps onto the unsigned 64-bit seed
    space), else from fresh OS entropy as ``torch.seed()`` does. The CPU generator (mt19937)
    keeps only the low 32 bits of a seed, so seeds that differ only above them (7 and
    7 + 2³²) would draw the same stream there: on CPU the high half is folded into the low
    one first (seeds below 2³² are unchanged).
    """
    if params.temperature <= 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
        return generator
    seed = params.seed % _SEED_MODULUS
    if generator.device.type == "cpu":
        seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    generator.manual_seed(seed)
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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the index of the first maximum of each row.

    On CPU, NumPy's SIMD argmax (same result, first occurrence among ties, on the same memory:
    no copy) is an order of magnitude faster than torch's index-returning reduction, which on a
    ``[512, 1024]`` block of logits costs about as much as the softmax. On other devices torch's.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)
