"""Commit rules: which of a block's masked positions receive their proposal this step.

Every rule works on a batch of rows at once: confidences ``c`` ``[R, M]`` of each row's
still-masked positions of its active block (ascending position order, then padding), where
padding and anything else that must never be committed holds ``-inf``. Each returns a boolean
``[R, M]`` of the positions to commit. Ties are broken towards the lowest position,
deterministically (``torch.topk`` and an unstable sort promise no order among equal values).

- **top-k** (LLaDA's low-confidence remasking) commits a scheduled number per step; the
  schedules below say how many.
- **threshold** (Fast-dLLM) commits every position at or above a confidence threshold, and
  always the most confident one.
- **LocalLeap** (arXiv:2510.07081): local determinism propagation around confident anchors.
  The rule follows the authors' ``get_transfer_index``, not a schedule-bound adaptation of it
  (a fixed number of commits per step): there is no per-step budget, so the number of forwards
  per block is data-dependent.
- **entropy bound** (the EB-sampler) commits the lowest-entropy positions while the entropies
  already taken sum to at most γ; **entropy threshold** every position below an entropy (nats)
  and always the lowest. Both read entropies from ``entropy_inverse`` scores.
- **JointThreshold** (LLaDA2.1 token editing) also rewrites unmasked positions of the open
  block; its inputs are every editable position, not only the masked ones.
- **JointThresholdInDel** (LLaDA2.2 insert/delete editing) adds two edit tokens, DELETE and
  SPLIT, that remove a position or open a new one, a final cleanup round and an anti-loop
  rule; it is sequential per row (host lists, :func:`indel_step`, :func:`indel_rebuild`).

**Schedules.**
A schedule turns ``num_masked`` (the masks of a block when it starts) and ``steps`` (the steps
the block gets) into a list of ``steps`` non-negative counts summing to ``num_masked``. Only
fixed-step (top-k) decoding uses a schedule; the threshold and LocalLeap modes commit a
data-dependent number of tokens per step.

Every schedule here satisfies (property-tested over many ``(n, s)``):

- ``len == steps``, ``sum == num_masked``, every count ``>= 0``;
- when ``steps <= num_masked`` no step commits zero tokens (a zero step is a wasted forward);
  when ``steps > num_masked`` every step commits at most one (the fewest empty steps);
- ``uniform``: counts differ by at most one, remainder first (LLaDA);
- ``cosine``: non-decreasing (few commits early, many late);
- ``front_loaded``: non-increasing (many early, few late), the mirror image of ``cosine``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# ---- schedules ---------------------------------------------------------------------------------


def _check(num_masked: int, steps: int) -> None:
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if num_masked < 0:
        raise ValueError("num_masked must be >= 0")


def uniform_schedule(num_masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: an equal share per step, remainder first.

    LLaDA's forward process masks each token independently with probability ``t`` and the
    sampler walks ``t`` from 1 to 0 in equal decrements, so the expected number of tokens
    unmasked per step is the same at every step: ``num_masked / steps``. Integer counts are
    ``base = num_masked // steps`` everywhere plus one extra token on each of the first
    ``num_masked % steps`` steps. When ``steps > num_masked`` the trailing steps commit
    nothing (they still cost a forward pass in the reference sampler).
    """
    _check(num_masked, steps)
    base, remainder = divmod(num_masked, steps)
    return [base + 1 if i < remainder else base for i in range(steps)]


def cosine_schedule(num_masked: int, steps: int) -> list[int]:
    """Few commits early, many late: MaskGIT's cosine masking curve.

    MaskGIT keeps a fraction ``γ(r) = cos(π r / 2)`` of the tokens masked at time
    ``r = i / steps``, so the committed fraction is ``F(r) = 1 − cos(π r / 2)``: flat at the
    start (when the model sees least context and its predictions are least reliable) and
    steep at the end. Counts come from rounding the cumulative target ``C_i = n·F(i/s)``,
    then repaired by :func:`_from_cumulative` (at least one token per step when there are at
    least as many tokens as steps, at most one otherwise).
    """
    _check(num_masked, steps)
    cumulative = [num_masked * (1.0 - math.cos(math.pi * i / (2 * steps))) for i in range(steps)]
    return sorted(_from_cumulative(cumulative, num_masked))


def front_loaded_schedule(num_masked: int, steps: int) -> list[int]:
    """Many commits early, few late: the mirror image of :func:`cosine_schedule`.

    The committed fraction is ``F(r) = sin(π r / 2) = 1 − F_cos(1 − r)``; we return the cosine
    counts reversed, which is that curve with the same rounding, so the two schedules are
    exact mirrors of each other (tested).
    """
    return cosine_schedule(num_masked, steps)[::-1]


def _from_cumulative(cumulative: list[float], n: int) -> list[int]:
    """Per-step counts from real cumulative targets ``C_0..C_{s-1}`` (``C_s = n`` implied).

    Naive rounding of a curve gives zero-commit steps (n = 32, s = 32 under cosine has many),
    each a wasted forward. Repair, left to right, with ``C_0 = 0`` before the first step:
    ``C_i ← max(C_i, C_{i−1} + 1)`` (at least one token per step) and
    ``C_i ≤ n − (s − i)`` (leave at least one token for each remaining step), when ``n ≥ s``.
    With fewer masks than steps some steps must be empty; then each step commits at most one
    token, so no more than ``s − n`` forwards are spent on empty steps. The caller sorts
    the counts, because rounding a convex curve can still yield e.g. ``[…, 1, 0, 1, …]``;
    sorting keeps the multiset (sum, minimum) and makes the shape monotone.
    """
    steps = len(cumulative)
    previous = 0
    counts = []
    for i in range(1, steps + 1):
        # Round half up (not Python's half-to-even) so the result is a plain function of C_i.
        target = n if i == steps else math.floor(cumulative[i] + 0.5)
        if n >= steps:
            target = min(max(target, previous + 1), n - (steps - i))
        else:
            # Mirror rule with fewer masks than steps: at most one token per step, so exactly
            # s − n steps are empty (the fewest possible) and the block still finishes.
            target = min(max(target, previous, n - (steps - i)), previous + 1)
        counts.append(target - previous)
        previous = target
    return counts


SCHEDULES: dict[str, Callable[[int, int], list[int]]] = {
    "uniform": uniform_schedule,
    "cosine": cosine_schedule,
    "front_loaded": front_loaded_schedule,
}


def block_schedule(name: str, num_masked: int, steps: int) -> list[int]:
    """Dispatch to the schedule called ``name`` (see ``DecodingParams.block_schedule``)."""
    schedule = SCHEDULES.get(name)
    if schedule is None:
        raise ValueError(f"unknown block_schedule {name!r} (available: {sorted(SCHEDULES)})")
    return schedule(num_masked, steps)


# ---- top-k and threshold -----------------------------------------------------------------------


def topk_commit_rows(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """LLaDA's low-confidence remasking: commit each row's ``k[r]`` most confident positions.

    The rest stay masked ("remasked") and are predicted again next step with more context.
    A stable descending sort over ascending positions breaks ties by the lowest position; a
    position's rank is its index in that order (the inverse permutation, by a second sort).
    """
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    rank = torch.argsort(order, dim=-1)
    return rank < k[:, None]


def argmax_onehot(confidence: torch.Tensor) -> torch.Tensor:
    """``[R, M]`` bool marking each row's most confident position (the first among ties)."""
    first = confidence.argmax(dim=-1, keepdim=True)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, first, True)


def threshold_commit_rows(confidence: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM's parallel decoding: ``{argmax c} ∪ {i : c_i ≥ threshold}`` per row.

    Fast-dLLM (arXiv:2505.22618, Thm. 1) shows that when every committed marginal has
    confidence above ``1 − ε`` with ``(n + 1)ε ≤ 1``, greedy parallel decoding of those ``n``
    positions equals greedy sequential decoding, so confident positions can be committed
    together. The most confident position is always committed, even below the threshold,
    so every step makes progress and a block of ``b`` masks needs at most ``b`` forwards.
    """
    return (confidence >= threshold[:, None]) | argmax_onehot(confidence)


# ---- LocalLeap ---------------------------------------------------------------------------------


def near_anchor_rows(
    offsets: torch.Tensor, anchors: torch.Tensor, radius: torch.Tensor, span: int
) -> torch.Tensor:
    """Whether some anchor lies within ``radius[r]`` of each position (``[R, M]`` bool).

    ``offsets`` ``[R, M]`` are the positions' offsets in their block (``0 ≤ offset < span``;
    padding may repeat an offset, it is never an anchor), ``anchors`` ``[R, M]`` bool over them.
    Distances are canvas distances, so committed positions between two masked ones count
    (the neighbourhood ``[a − W, a + W]`` is an interval of the canvas). Computed with a prefix
    sum of anchor counts over the block: ``O(span)`` per row, no ``[M, M]`` matrix.
    """
    rows = offsets.shape[0]
    dense = torch.zeros(rows, span, dtype=torch.long, device=offsets.device)
    dense.scatter_add_(1, offsets, anchors.long())
    # prefix[j] = number of anchors at offsets < j; window count = prefix[hi] − prefix[lo].
    prefix = torch.nn.functional.pad(dense.cumsum(1), (1, 0))
    lo = (offsets - radius[:, None]).clamp(min=0)
    hi = (offsets + radius[:, None] + 1).clamp(max=span)
    return (prefix.gather(1, hi) - prefix.gather(1, lo)) > 0


def local_leap_commit_rows(
    confidence: torch.Tensor,
    offsets: torch.Tensor,
    anchor_threshold: torch.Tensor,
    neighbor_threshold: torch.Tensor,
    radius: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """LocalLeap's commit set for one step, per row (``[R, M]`` bool).

    With κ = ``anchor_threshold``, τ = ``neighbor_threshold`` (τ ≤ κ), W = ``radius``::

        A      = {a masked in block : c_a ≥ κ}                 # anchors, this step only
        commit = {argmax c} ∪ {i : c_i ≥ κ} ∪ {i : c_i ≥ τ and |i − a| ≤ W for some a ∈ A}

    The paper's observation is that positions next to a confident prediction are themselves
    close to final ("local determinism"), and that this consistency decays with distance, so a
    relaxed threshold τ is safe only within W of an anchor. Anchors are positions that are
    masked *now* and reach κ in *this* step: a token committed earlier does not widen the
    relaxed region, and a τ-level neighbour committed this step does not become an anchor
    (one step of propagation). The argmax keeps progress when no position reaches κ, in
    which case exactly one token is committed. With W = 0 or τ = κ the rule is exactly
    :func:`threshold_commit_rows` at κ.
    """
    anchors = confidence >= anchor_threshold[:, None]
    near = near_anchor_rows(offsets, anchors, radius, span)
    relaxed = near & (confidence >= neighbor_threshold[:, None])
    return threshold_commit_rows(confidence, anchor_threshold) | relaxed


# ---- entropy rules -----------------------------------------------------------------------------


def entropy_of_score(score: torch.Tensor) -> torch.Tensor:
    """Entropies ``H`` in nats from ``entropy_inverse`` scores ``exp(−H)`` (``[R, M]``).

    Padding and anything else that must never be committed (score ``−inf`` or 0) maps to
    ``+inf``, which sorts last and passes no entropy test."""
    return torch.where(score > 0, -torch.log(score.clamp_min(1e-38)), float("inf"))


def entropy_bound_commit_rows(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The EB-sampler (arXiv:2505.24857): reveal the lowest-entropy positions while the
    entropies already revealed this step sum to at most ``bound[r]`` (γ, nats).

    With a row's entropies sorted ascending ``H_(1) ≤ H_(2) ≤ …`` the ``k``-th is committed
    when ``Σ_{j<k} H_(j) ≤ γ``; the first always is (so every step makes progress). The error of
    drawing the chosen positions independently instead of jointly is their total correlation
    ``Σ H(x_i) − H(x_S) ≤ Σ H(x_i)``, so the bound caps it and γ trades forwards for that
    error: γ = 0 commits one position per step unless several are certain.
    Ties are taken lowest position first (a stable sort over ascending positions).
    """
    order = torch.sort(entropy, dim=-1, stable=True).indices
    ranked = entropy.gather(-1, order)
    finite = torch.where(torch.isfinite(ranked), ranked, 0.0)
    before = torch.nn.functional.pad(finite.cumsum(-1)[:, :-1], (1, 0))
    take = before <= bound[:, None]
    take[:, 0] = True
    return torch.zeros_like(take).scatter_(-1, order, take)


def entropy_threshold_commit_rows(entropy: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """d3LLM's entropy threshold: every position whose entropy is below ``threshold[r]`` (nats),
    and always the lowest-entropy one (the first among ties)."""
    return (entropy < threshold[:, None]) | argmax_onehot(-entropy)


# ---- LLaDA2.1 token editing --------------------------------------------------------------------


def joint_threshold_commit_rows(
    confidence: torch.Tensor,
    proposals: torch.Tensor,
    current: torch.Tensor,
    masked: torch.Tensor,
    valid: torch.Tensor,
    mask_threshold: torch.Tensor,
    edit_threshold: torch.Tensor,
) -> torch.Tensor:
    """LLaDA2.1's JointThreshold step (SGLang's ``JointThreshold``): which positions of the
    active block receive their proposal, ``[R, M]`` bool over each row's editable positions
    (the block's positions past the prompt, ascending).

    Mask to token (M2T): the masked positions whose confidence is strictly above τ
    (``mask_threshold``), else the single most confident masked position. Token to token
    (T2T), from the first step on: the unmasked positions whose confidence is strictly above
    τ_edit (``edit_threshold``) and whose proposal differs from the token there. An editing
    model is trained to put a useful distribution on unmasked positions too, so a committed
    token it no longer believes in can be rewritten while the block is still open.
    """
    open_masks = masked & valid
    m2t = open_masks & (confidence > mask_threshold[:, None])
    fallback = open_masks.any(-1) & ~m2t.any(-1)
    best = argmax_onehot(confidence.masked_fill(~open_masks, float("-inf")))
    m2t |= best & fallback[:, None]
    t2t = ~masked & valid & (confidence > edit_threshold[:, None]) & (proposals != current)
    return m2t | t2t


# ---- LLaDA2.2 insert/delete editing ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InDelCounters:
    """A block's step counters under JointThresholdInDel: forwards that decided a step
    (``update_steps``) and, of those, the ones that began with no original mask left
    (``post_edit_steps``; cumulative, never reset: SGLang's choice, which its docstring
    contrasts with the released reference's reset)."""

    update_steps: int = 0
    post_edit_steps: int = 0


@dataclass(frozen=True, slots=True)
class InDelStep:
    """One JointThresholdInDel step of one row: ``writes[i]`` is the token written at the
    block's ``i``-th editable position (``None``: left as it is), ``final`` whether this is
    the block's cleanup round, ``counters`` the block's counters after the step."""

    writes: list[int | None]
    final: bool
    counters: InDelCounters


def indel_step(
    current: Sequence[int],
    original: Sequence[bool],
    proposals: Sequence[int],
    confidence: Sequence[float],
    clean: Sequence[int],
    counters: InDelCounters,
    *,
    mask_id: int,
    block_size: int,
    mask_threshold: float,
    edit_threshold: float,
    max_post_edit_steps: int,
    seen_before: bool,
    history: Sequence[set[int]],
    redraw: Callable[[int, set[int]], int],
) -> InDelStep:
    """LLaDA2.2's JointThresholdInDel step (SGLang's ``JointThresholdInDel``) over the open
    block's editable positions (past the prompt, ascending): ``current`` tokens,
    ``original[i]`` whether position ``i`` holds (or carried) a mask the block started with,
    the model's ``proposals`` (argmax, mask excluded) with their ``confidence`` (softmax
    probability), and ``clean`` (the argmax with the mask and both edit tokens excluded).

    With ``O`` the original masks still unresolved and ``I`` the masks DELETE/SPLIT
    introduced:

    1. count the step; a step with ``O = 0`` also counts a post-edit step. The **final
       (cleanup) round**: post-edit steps ≥ ``max_post_edit_steps`` (> 0), or
       ``max_post_edit_steps = 0`` and ``O = 0``, or more update steps than
       ``block_size + max_post_edit_steps``.
    2. M2T: final → every mask. ``O > 0`` → ``need = 1 + I`` masks: all above τ (strictly)
       if that many are, else the ``need`` most confident (so each step resolves at least one
       original mask while absorbing the masks edits introduced). ``O = 0`` → every mask.
       With ``max_post_edit_steps = 0`` a step whose M2T takes every original mask left is
       the final round.
    3. T2T: unmasked positions whose proposal is strictly above τ_edit and differs.
    4. Final round: what is written is ``clean`` (no mask, DELETE or SPLIT can survive it).
    5. Anti-loop (not final): if this block state was seen before, the least confident
       position about to change is redrawn excluding every token written there before
       (``redraw(i, excluded)``; the mask is always excluded), so a two-state oscillation
       cannot repeat forever.
    """
    masks = [i for i, token in enumerate(current) if token == mask_id]
    unresolved = [i for i in masks if original[i]]
    introduced = len(masks) - len(unresolved)
    update = counters.update_steps + 1
    post = counters.post_edit_steps + (0 if unresolved else 1)
    final = (
        (max_post_edit_steps > 0 and post >= max_post_edit_steps)
        or (max_post_edit_steps == 0 and not unresolved)
        or update > block_size + max_post_edit_steps
    )
    m2t = masks
    if not final and unresolved:
        need = 1 + introduced
        above = [i for i in masks if confidence[i] > mask_threshold]
        # The most confident first, the lowest position among equals (a stable sort).
        m2t = above if len(above) >= need else sorted(masks, key=lambda i: -confidence[i])[:need]
        if max_post_edit_steps == 0 and set(unresolved) <= set(m2t):
            final, m2t = True, masks
    t2t = [
        i
        for i, token in enumerate(current)
        if token != mask_id and confidence[i] > edit_threshold and proposals[i] != token
    ]
    chosen = sorted(set(m2t) | set(t2t))
    source = clean if final else proposals
    writes: list[int | None] = [None] * len(current)
    for i in chosen:
        writes[i] = source[i]
    if seen_before and not final:
        changing = [i for i in chosen if writes[i] != current[i]]
        if changing:
            i = min(changing, key=lambda j: (confidence[j], j))
            writes[i] = redraw(i, {*history[i], mask_id})
    return InDelStep(writes, final, InDelCounters(update, post))


def indel_rebuild(
    current: Sequence[int],
    original: Sequence[bool],
    writes: Sequence[int | None],
    *,
    mask_id: int,
    delete_id: int,
    split_id: int,
) -> tuple[list[int], list[bool]]:
    """The editable part of a block after a step's ``writes`` (``None``: unchanged), and each
    position's original-mask flag, rebuilt left to right from the block *before* the writes:
    DELETE drops the position; SPLIT emits a new mask (not original) then the token that was
    there before the write; any other write replaces the token. The result is padded with
    (non-original) masks or cut at the tail to the block's length:
    ``[a, DELETE, c, d] → [a, c, d, M]``, ``[a, SPLIT, c, d] (over [a, b, c, d]) →
    [a, M, b, c]``. A flag travels with its token, so an original mask moved by an edit is
    still counted until it is filled."""
    tokens: list[int] = []
    flags: list[bool] = []
    for before, was_original, written in zip(current, original, writes, strict=True):
        if written == delete_id:
            continue
        if written == split_id:
            tokens += [mask_id, before]
            flags += [False, was_original]
            continue
        token = before if written is None else written
        tokens.append(token)
        flags.append(was_original)
    length = len(current)
    tokens += [mask_id] * (length - len(tokens))
    flags += [False] * (length - len(flags))
    return tokens[:length], flags[:length]
