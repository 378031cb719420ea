"""The batched sampler's tensor math: proposals, their confidence and exact draws.

Everything here is tensor in, tensor out over every row of a step, reads nothing back to the
host, and takes each request's randomness from that request's own generator, so a row's draw
never depends on its batch-mates. The rules that pick which proposals a step commits are in
``commit_rules.py``; the algorithms that call both are ``canvas.py``, ``blocks.py``,
``selfspec.py`` and ``linear_spec.py``.

- **Proposals** (masked diffusion): at each still-masked position the argmax at T = 0, else a
  Gumbel-max sample from ``softmax(z / T)``, scored with the request's confidence metric
  (``top1_prob`` or ``entropy_inverse``, both on the scale ``(0, 1]`` with 1 = certain, so one
  threshold means the same kind of thing under either).
- **Exact draws** (self-speculation): ``softmax(z / T)`` in float64 with the mask id removed,
  sampled by an exponential race or by inverse CDF from one uniform per row.
- **Logits** may be a dense ``[R, M, V]`` tensor or, under tensor parallelism,
  :class:`~dllm_serve.decoding.protocol.ShardedLogits` whose reductions run on every rank; the
  helpers at the end let one sampler serve both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import StepLogits, logit_layout
from dllm_serve.models.attention import to_device

# ---- generators and draws ----------------------------------------------------------------------


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


# ---- confidence --------------------------------------------------------------------------------


def top1_prob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)[..., tokens]`` for logits ``[..., V]`` and tokens ``[...]``.

    This is LLaDA's ``low_confidence`` score: the probability, under the *untempered* model
    distribution, of the token that was proposed (the argmax at T = 0, the sampled token at
    T > 0). It is computed as ``exp(z[token] - logsumexp(z))``, in the logits' own float
    precision (float32 from the engine), so the ``[N, V]`` softmax is never materialised and
    no float64 copy of the logits is made: the argmax is unchanged by precision, and the score
    is a well-defined probability either way. Callers that want float64 rankings pass float64
    logits.
    """
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp(chosen - torch.logsumexp(logits, dim=-1))


def entropy_inverse(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``exp(−H(p))`` per row, ``p = softmax(logits)`` in the logits' precision, H in nats.

    ``exp(−H)`` is the inverse of the distribution's perplexity: ``1/k`` for a distribution
    uniform over ``k`` tokens, 1 for a one-hot one. We use it rather than ``−H`` or
    ``1/(1+H)`` because it keeps thresholds on the probability scale of :func:`top1_prob`:
    since ``H ≥ −log max_v p_v`` (Shannon entropy is at least the min-entropy),
    ``exp(−H) ≤ max_v p_v``, so a threshold of 0.9 on ``entropy_inverse`` is never looser
    than 0.9 on the greedy ``top1_prob`` — it additionally demands that the rest of the mass
    is not spread out. For top-k ranking it orders positions exactly as ``−H`` would (any
    strictly increasing transform of ``−H`` ranks identically; tested).

    It scores the whole predictive distribution, so ``tokens`` (the proposal) is not used:
    at T > 0 a position's confidence does not depend on which token was drawn. Entries at −∞
    (the suppressed mask id) have ``p = 0`` and contribute ``0·log 0 = 0``.
    """
    del tokens  # same signature as top1_prob; the entropy does not depend on the proposal
    return entropy_inverse_of(torch.softmax(logits, dim=-1))


def entropy_inverse_of(probs: torch.Tensor) -> torch.Tensor:
    """:func:`entropy_inverse` from probabilities ``[..., V]`` already computed."""
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)
    # Rounding can make H of a one-hot row a hair negative; clamp so the score stays ≤ 1.
    return torch.exp(-entropy.clamp_min(0.0))


METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "top1_prob": top1_prob,
    "entropy_inverse": entropy_inverse,
}


def confidence(name: str, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Dispatch to the metric called ``name`` (see ``DecodingParams.confidence_metric``)."""
    metric = METRICS.get(name)
    if metric is None:
        raise ValueError(f"unknown confidence_metric {name!r} (available: {sorted(METRICS)})")
    return metric(logits, tokens)


# ---- proposals ---------------------------------------------------------------------------------


# Row → (temperature, generator) of the rows that draw this step.
Draws = dict[int, tuple[float, torch.Generator | None]]


def propose(
    logits: StepLogits,
    mask_id: int,
    counts: list[int],
    draws: Draws,
    metrics: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposals ``[R, M]`` and each row's confidence under its own metric ``[R, M]``.

    Row ``r``'s first ``counts[r]`` positions are its masked positions (anything after them is
    padding, scored but never committed by the caller). The argmax, the draws and the softmax
    run on the flat requested positions; only their small results are laid out per row. The
    mask id is a real vocabulary entry; proposing it would "commit" a mask and break the count
    (dInfer guards the same way), so it is excluded, which also removes it from the
    distribution the confidence is computed under.
    """
    if logits.sharded is not None:
        x0, top1, inverse = logits.sharded.propose(mask_id, counts, draws)
        return x0, _pick_metric(metrics, top1, inverse, x0.device)
    assert logits.flat is not None
    # In place: the logits are this step's and are not read again.
    z = _writable(logits.flat.float())
    z.select(-1, mask_id).fill_(float("-inf"))
    offsets = logits.offsets
    sampled = {
        r: gumbel_argmax(z[offsets[r] : offsets[r] + counts[r]], temperature, generator)
        for r, (temperature, generator) in draws.items()
    }
    x0 = argmax(z)  # greedy proposals (the first maximum, as torch.argmax)
    for r, tokens in sampled.items():
        x0[offsets[r] : offsets[r] + tokens.shape[0]] = tokens
    # One fused softmax serves both metrics: top1_prob is p[x0] (LLaDA's low_confidence, the
    # untempered probability of the proposal), entropy_inverse is exp(−H(p)). The proposals
    # are drawn, so on CPU it overwrites the logits (no fresh [N, V] buffer to fault in every
    # step); the CUDA caching allocator makes a new one free there.
    cpu = z.device.type == "cpu"
    probs = torch.softmax(z, dim=-1, out=z) if cpu else torch.softmax(z, -1)
    per_row = logits.per_row
    if set(metrics) == {"entropy_inverse"}:
        return per_row(x0), per_row(entropy_inverse_of(probs))
    top1 = per_row(probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1))
    if "entropy_inverse" not in metrics:
        return per_row(x0), top1
    inverse = per_row(entropy_inverse_of(probs))
    return per_row(x0), _pick_metric(metrics, top1, inverse, z.device)


def _pick_metric(
    metrics: list[str], top1: torch.Tensor, inverse: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Each row's confidence under its own metric, ``[R, M]``."""
    if all(m == "top1_prob" for m in metrics):
        return top1
    if all(m == "entropy_inverse" for m in metrics):
        return inverse
    entropic = to_device([m == "entropy_inverse" for m in metrics], device)
    return torch.where(entropic[:, None], inverse, top1)


# ---- exact draws -------------------------------------------------------------------------------


def target_probs(logits: torch.Tensor, temperature: float, mask_id: int) -> torch.Tensor:
    """``softmax(logits / T)`` in float64 with the mask id removed, rows ``[R, V]``.

    The mask id is a real vocabulary entry; it must never be emitted, and it is excluded the
    same way everywhere (verify, clean, correction and drafts) so p is one consistent target.
    """
    z = logits.to(torch.float64, copy=True)
    z[..., mask_id] = float("-inf")
    return torch.softmax(z / temperature, dim=-1)


def greedy_tokens(logits: StepLogits, mask_id: int) -> torch.Tensor:
    """``argmax`` per requested position with the mask id excluded (the T = 0 limit of
    :func:`target_probs`), laid out per row: ``[R, M]``.

    In the logits' own precision (widening to float64 is exact, so it cannot change an argmax)
    and in place: the mask id's logits are set to −inf. Sharded logits (tensor parallelism)
    are reduced per rank instead, untouched.
    """
    if logits.sharded is not None:
        return logits.sharded.greedy(mask_id)
    assert logits.flat is not None
    logits.flat[:, mask_id] = float("-inf")
    return logits.per_row(argmax(logits.flat))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row of ``probs`` ``[R, V]`` (exponential race, float64).

    ``argmin_i E_i / p_i`` with ``E_i ~ Exp(1)`` i.i.d. picks ``i`` with probability
    ``p_i / Σ p`` (the minimum of independent Exp(p_i) clocks); zero-probability entries get
    an infinite clock and are never picked. Same law as Gumbel-max, without logs of p.
    """
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
    clocks = -torch.log(u) / probs  # p = 0 → inf; u = 0 → inf (never the argmin)
    return clocks.argmin(dim=-1)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row of ``probs`` ``[R, V]`` (float64) from one uniform per row.

    ``x = (1 − u) · Σp`` lies in ``(0, Σp]``; the first index whose cumulative sum reaches it
    is ``i`` with probability ``p_i / Σp``, and never an entry with ``p_i = 0`` (its interval is
    empty). One random number per row instead of one per vocabulary entry.
    """
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device)
    picks = torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:])
    return picks.squeeze(-1).clamp_max(probs.shape[-1] - 1)


# ---- dense or sharded logits -------------------------------------------------------------------


def writable(logits: StepLogits) -> StepLogits:
    """Logits a sampler may overwrite in place: dense ones themselves, or a copy of an
    inference-mode tensor used outside inference mode (tests); sharded ones as they are (their
    reductions never write)."""
    if logits.flat is None:
        return logits
    flat = _writable(logits.flat)
    return logits if flat is logits.flat else replace(logits, flat=flat)


def _writable(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        return tensor.clone()
    return tensor


def select_rows(logits: StepLogits, rows: Sequence[int]) -> StepLogits:
    """``logits`` restricted to ``rows``: their positions gathered (dense; one host→device
    copy for the positions and the new layout) or a view of the same sharded logits."""
    if logits.sharded is not None:
        counts = [logits.counts[r] for r in rows]
        return StepLogits(None, counts, list(logits.offsets[: len(rows)]), None,
                          logits.sharded.select_rows(rows))  # fmt: skip
    assert logits.flat is not None
    counts = [logits.counts[r] for r in rows]
    positions: list[int] = []
    for r in rows:
        positions.extend(range(logits.offsets[r], logits.offsets[r] + logits.counts[r]))
    offsets, layout = logit_layout(counts)
    packed = to_device(positions + layout, logits.flat.device, torch.long)
    flat = logits.flat.index_select(0, packed[: len(positions)])
    index = packed[len(positions) :].view(len(rows), max(counts))
    return StepLogits(flat, counts, offsets, index)


def dense_rows(logits: StepLogits, rows: Sequence[int]) -> dict[int, torch.Tensor]:
    """Row ``r``'s full-vocabulary logits at its requested positions for each ``r`` in
    ``rows`` (views of the flat logits; one gather for all of them when sharded)."""
    if not rows:
        return {}
    if logits.sharded is None:
        return {r: logits.row(r) for r in rows}
    gathered = logits.sharded.dense(rows)
    return {r: gathered[i] for i, r in enumerate(rows)}


def dense_logits(logits: StepLogits, rows: Sequence[int]) -> StepLogits:
    """``logits`` restricted to ``rows`` as dense logits whatever their form: a gather of
    their positions when dense (:func:`select_rows`), or under tensor parallelism their
    whole rows gathered on rank 0 (one collective, announced to the workers like every
    reduction, ``engine/parallel/vocab.py``), laid out per row as the sharded logits are.

    Why: a row whose sampler must edit its distribution (a grammar's mask, then the
    lookahead over the masked log-probabilities) runs the dense sampler's exact code on
    them, so it gets the tokens it gets at TP = 1; the other rows stay sharded."""
    if logits.sharded is None:
        return select_rows(logits, rows)
    gathered = logits.sharded.dense(rows)  # [len(rows), M, V], every row M positions wide
    if any(logits.counts[r] != gathered.shape[1] for r in rows):
        # Sharded logits are laid out per row with one width (StepLogits.padded).
        raise RuntimeError("sharded logits must be laid out per row with one width")
    return StepLogits.padded(gathered)


def sample_split(
    logits: StepLogits,
    dense: Sequence[int],
    run: Callable[[list[int], StepLogits], torch.Tensor],
    fill: int,
) -> torch.Tensor:
    """A sampler's result ``[R, W]`` computed in two parts: ``run(rows, their logits)`` on
    the rows in ``dense`` with their logits whole (:func:`dense_logits`), then on the other
    rows with the logits as they are (sharded: the reductions per rank, no gather). The
    parts go side by side, a narrower one padded with ``fill`` (which no commit reads: a
    row's result is as wide as its own sampler made it).

    Rows are independent (each has its own rule, generator and grammar), so each row gets
    what it gets in a batch of its own kind. Every collective is run by rank 0 in this one
    order and announced, so the workers join them in the same order."""
    chosen = set(dense)
    rest = [r for r in range(logits.rows) if r not in chosen]
    parts = [(list(dense), run(list(dense), dense_logits(logits, dense)))]
    if rest:
        parts.append((rest, run(rest, select_rows(logits, rest))))
    width = max(part.shape[1] for _, part in parts)
    first = parts[0][1]
    out = torch.full((logits.rows, width), fill, dtype=first.dtype, device=first.device)
    for rows, part in parts:
        out[to_device(rows, out.device, torch.long), : part.shape[1]] = part.to(out.dtype)
    return out


def seed_tokens(logits: StepLogits, mask_id: int) -> torch.Tensor:
    """``[R]``: each row's argmax at its first requested position, mask id excluded; the
    logits are left as they were."""
    if logits.sharded is not None:
        return logits.sharded.greedy(mask_id)[:, 0]
    assert logits.flat is not None and logits.index is not None
    first = logits.flat.index_select(0, logits.index[:, 0]).float()
    first[:, mask_id] = float("-inf")
    return argmax(first).to(logits.flat.device)


# ---- structured output -------------------------------------------------------------------------


def restrict_to_bitmasks(
    logits: StepLogits, at: Sequence[int], masks: Sequence[bytes]
) -> StepLogits:
    """``logits`` with flat position ``at[i]`` restricted to the tokens set in ``masks[i]`` (a
    little-endian bitmask over the vocabulary, 32-bit words: decoding/grammar.py), the others
    at −inf. One host→device copy of the packed masks; the bits are unpacked on the device.
    Dense logits only: under tensor parallelism the constrained rows are gathered whole
    first (:func:`dense_logits`, :func:`sample_split`)."""
    if logits.flat is None:
        raise RuntimeError("grammar masks apply to dense logits: gather the rows first")
    if not at:
        return logits
    logits = writable(logits)
    flat = logits.flat
    assert flat is not None
    device, vocab, n = flat.device, flat.shape[-1], len(at)
    width = len(masks[0])
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8)
    packed = packed.to(device, non_blocking=True)
    shifts = torch.arange(8, device=device, dtype=torch.uint8)
    allowed = ((packed.view(n, width, 1) >> shifts) & 1).view(n, width * 8).bool()
    if allowed.shape[1] < vocab:  # an LM head wider than the model's vocabulary
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = to_device(list(at), device, torch.long)
    flat[index] = flat[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits
