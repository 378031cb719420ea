"""The two training objectives, as batch builders + a loss over the model's logits.

- LLaDA (masked diffusion, bidirectional): the answer region — answer, EOT, EOS padding, all
  trained as ordinary tokens as in LLaDA's SFT — is masked with a per-row ratio t ~ U(ε, 1);
  the loss is the cross-entropy on masked positions weighted by 1/t (LLaDA's objective), the
  prompt is never masked. Optionally part of each batch is two-stream rows
  (:func:`two_stream_row`) in which every answer token is predicted by a MASK position from a
  clean left context — the same model and loss, other masked states.
- I-DLM (introspective causal, logit shift): the answer is cut at a random point and followed
  by m ∈ [0, N−1] MASK tokens, the layout of an ISD round's tail. Every position (clean or
  MASK) predicts the true next token, so the MASK positions learn to draft the next m tokens
  that the clean causal path would produce — drafts that agree with the model's own causal
  predictions on tasks with one right answer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dllm_serve.models.loader import LoadedModel
from dllm_serve_train.tasks import Example

EPS = 1e-3


@dataclass(slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, L]
    attn_mask: torch.Tensor  # [B, 1, L, L] bool
    targets: torch.Tensor  # [B, L] token to predict at each position (-100 = no loss)
    weights: torch.Tensor  # [B, L] loss weight per position
    normalizer: float  # the loss is sum(weight * CE) / normalizer

    def to(self, device: str | torch.device) -> TrainBatch:
        move = (self.input_ids, self.positions, self.attn_mask, self.targets, self.weights)
        return TrainBatch(*(t.to(device) for t in move), self.normalizer)


def encode(loaded: LoadedModel, ex: Example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + the end-of-turn token) through the real chat template: its
    rendering of the system prompt and earlier turns too (``ex.context``)."""
    prompt = loaded.chat_prompt_ids(ex.messages())
    answer = loaded.tokenizer.encode(ex.answer, add_special_tokens=False)
    end = loaded.eot_id if loaded.eot_id is not None else loaded.eos_id
    return prompt, [*answer, end]


def llada_batch(
    loaded: LoadedModel,
    examples: list[Example],
    rng: random.Random,
    max_pad: int = 48,
    canvas: int = 32,
    weighting: str = "token_mean",
    causal: bool = False,
    ar_fraction: float = 0.0,
) -> TrainBatch:
    """Answer regions are EOS-padded to the default ``canvas`` (the inference layout at
    default settings) three times in four, else by a random 0–``max_pad`` tokens.

    ``weighting``: ``"inverse_t"`` is LLaDA's ELBO weight (each masked token's CE times
    1/t, over the region length); ``"row_mean"`` replaces the expected masked count t·|region|
    in that weight by the realised count, i.e. each row's mean CE over its masked tokens,
    averaged over rows; ``"token_mean"`` averages CE over the batch's masked tokens.
    With small batches of short answers the 1/t weight lets the rare tiny-t rows (one masked
    token, weight up to 1000×) dominate every batch gradient, which the gradient clip then
    shrinks for all other rows; ``row_mean`` keeps LLaDA's equal weight per row without that
    variance, ``token_mean`` lets the heavily masked rows dominate instead
    (docs/training.md has what each choice reached).

    ``causal``: the same rows and targets under a causal mask (each masked position predicts
    its own token from what lies left of it, no logit shift), for a causal first stage that
    is later switched to LLaDA's bidirectional attention.

    ``ar_fraction``: that share of the rows are two-stream autoregressive rows
    (:func:`two_stream_row`) instead of randomly masked ones.
    """
    rows, targets, weights, layouts = [], [], [], []
    # Stratified mask ratios (one per 1/B slice of (0, 1), MDLM's low-discrepancy sampler):
    # the same objective as i.i.d. t ~ U(ε, 1), with less variance from rare tiny t.
    offset = rng.random()
    strata = [(i + offset) / len(examples) for i in range(len(examples))]
    rng.shuffle(strata)
    n_ar = round(ar_fraction * len(examples))
    for i, (ex, u) in enumerate(zip(examples, strata, strict=True)):
        prompt, answer = encode(loaded, ex)
        if i < n_ar:
            row, tgt, layout = two_stream_row(prompt, answer, loaded.mask_id)
            rows.append(row)
            targets.append(tgt)
            weights.append([1.0 / len(answer) if weighting == "row_mean" else 1.0] * len(row))
            layouts.append(layout)
            continue
        layouts.append(None)
        pad = canvas - len(answer) if rng.random() < 0.75 else rng.randint(0, max_pad)
        region = answer + [loaded.eos_id] * max(pad, 0)  # EOS padding tail
        t = EPS + (1 - EPS) * u
        masked = [rng.random() < t for _ in region]
        if not any(masked):
            masked[rng.randrange(len(region))] = True
        rows.append(
            prompt + [loaded.mask_id if m else tok for tok, m in zip(region, masked, strict=True)]
        )
        targets.append(
            [-100] * len(prompt)
            + [tok if m else -100 for tok, m in zip(region, masked, strict=True)]
        )
        if weighting == "inverse_t":
            w = 1.0 / (t * len(region))
        elif weighting == "row_mean":
            w = 1.0 / sum(masked)
        else:
            w = 1.0
        weights.append([0.0] * len(prompt) + [w] * len(region))
    if n_ar and weighting == "inverse_t":
        raise ValueError("two-stream rows have no mask ratio to weight by 1/t")
    if weighting in ("inverse_t", "row_mean"):  # Σ_rows Σ_masked w·CE, averaged over rows
        return _pad(rows, targets, weights, loaded, causal, len(rows), layouts)
    if weighting != "token_mean":
        raise ValueError(f"unknown weighting {weighting!r}")
    n_masked = sum(tok != -100 for tgt in targets for tok in tgt)
    return _pad(rows, targets, weights, loaded, causal, n_masked, layouts)


def llada_tail_batch(
    loaded: LoadedModel,
    examples: list[Example],
    rng: random.Random,
    max_canvas: int = 1024,
    block_range: tuple[int, int] = (16, 32),
    min_canvas: int = 0,
) -> TrainBatch:
    """Rows in the state of a long canvas's first block: what makes the answer canvas-free.

    A request for 1024 tokens is decoded in blocks of about the trained canvas (block
    ``b`` in ``block_range``); while the first block is denoised, every position after it is
    still MASK and, attention being bidirectional, visible. A model trained on 32-token
    canvases only has never seen hundreds of MASKs to its right and writes nothing useful
    there. Each batch here shares one canvas length ``L`` drawn log-uniformly from
    ``[b, max_canvas]``: the region is answer + EOT + EOS padding to ``L``; positions after
    ``b`` are all MASK (no loss, as at inference they are decoded later); the block is masked
    either at a random ratio or as a suffix after a clean prefix (the left-to-right state
    confidence decoding reaches). Cross-entropy on the block's masked positions.
    ``min_canvas`` raises the lower end of ``L``'s range (long canvases only).
    """
    b = rng.randint(*block_range)
    low = max(b, min(min_canvas, max_canvas))
    drawn = int(math.exp(rng.uniform(math.log(low), math.log(max_canvas))))
    encoded = [encode(loaded, ex) for ex in examples]
    length = max(drawn, *(len(answer) for _, answer in encoded))
    rows, targets, weights = [], [], []
    for prompt, answer in encoded:
        region = answer + [loaded.eos_id] * (length - len(answer))
        block = max(b, len(answer))  # an answer longer than the block keeps its tokens
        if rng.random() < 0.5:
            t = EPS + (1 - EPS) * rng.random()
            masked = [rng.random() < t for _ in range(block)]
        else:
            clean = rng.randrange(block)
            masked = [i >= clean for i in range(block)]
        if not any(masked):
            masked[rng.randrange(block)] = True
        masked += [True] * (length - block)
        rows.append(
            prompt + [loaded.mask_id if m else tok for tok, m in zip(region, masked, strict=True)]
        )
        targets.append(
            [-100] * len(prompt)
            + [
                tok if m and i < block else -100
                for i, (tok, m) in enumerate(zip(region, masked, strict=True))
            ]
        )
        weights.append([0.0] * len(prompt) + [1.0] * length)
    n_masked = sum(tok != -100 for tgt in targets for tok in tgt)
    return _pad(rows, targets, weights, loaded, False, n_masked)


def two_stream_row(
    prompt: list[int], answer: list[int], mask_id: int
) -> tuple[list[int], list[int], tuple[torch.Tensor, torch.Tensor]]:
    """One autoregressive training row for a masked (no logit shift) model.

    Layout: ``prompt + answer + [MASK] * len(answer)``. The MASK copy of answer token j sits
    at j's rotary position and attends to the prompt, the clean answer tokens before j and
    itself; the clean answer attends causally (prompt + its own left), the prompt to itself.
    So every answer token is predicted, in one pass, from a MASK query with a clean left
    context: the state left-to-right denoising reaches, and the same per-token signal a
    causal model gets from next-token prediction, which a randomly masked row gives only to
    its masked tokens and with parts of their context masked too. No position sees a token
    it predicts (XLNet's two streams, here for a model without logit shift).

    Returns (row, targets, (positions, attention mask [len, len])).
    """
    p, n = len(prompt), len(answer)
    row = prompt + answer + [mask_id] * n
    targets = [-100] * (p + n) + answer
    positions = torch.cat((torch.arange(p + n), torch.arange(p, p + n)))
    allowed = torch.zeros(p + 2 * n, p + 2 * n, dtype=torch.bool)
    allowed[:, :p] = True  # everyone sees the prompt
    allowed[p : p + n, p : p + n] = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[p + n :, p : p + n] = torch.ones(n, n, dtype=torch.bool).tril(-1)
    allowed[p + n :, p + n :] = torch.eye(n, dtype=torch.bool)
    return row, targets, (positions, allowed)


def idlm_batch(
    loaded: LoadedModel,
    examples: list[Example],
    rng: random.Random,
    max_stride: int = 8,
    ar_fraction: float = 0.0,
) -> TrainBatch:
    """Rows for the I-DLM objective (causal attention, logit shift): the prompt, the answer
    clean up to a random cut, then up to ``max_stride - 1`` MASKs. Every clean position
    predicts the next token (the autoregressive verify the server decodes with), every MASK
    the answer token past it (a self-speculative draft).

    ``ar_fraction``: that share of the rows keep the whole answer clean and no MASK, so each
    of them trains next-token prediction over the whole answer; the random cut gives a row
    that signal for half its answer on average, and the served answer is the greedy
    autoregressive one (greedy ISD is token-identical to it)."""
    rows, targets, weights = [], [], []
    n_ar = round(ar_fraction * len(examples))
    for i, ex in enumerate(examples):
        prompt, answer = encode(loaded, ex)
        # Drawn for every row, AR rows too, so the other rows get the draws they got without
        # --ar-fraction (a recorded command reproduces its run).
        cut = rng.randint(0, len(answer) - 1)  # answer[:cut] is clean, then masks
        if i < n_ar:
            cut = len(answer) - 1  # all clean: the last position predicts the final token
        n_masks = min(rng.randint(0, max_stride - 1), len(answer) - cut - 1)
        clean = prompt + answer[:cut]
        row = clean + [loaded.mask_id] * n_masks
        full = prompt + answer
        # Logit shift: position j predicts token j + 1.
        tgt = [-100] * (len(prompt) - 1) + full[len(prompt) : len(row) + 1]
        tgt += [-100] * (len(row) - len(tgt))
        rows.append(row)
        targets.append(tgt)
        weights.append([1.0] * len(row))
    n_targets = sum(t != -100 for tgt in targets for t in tgt)
    return _pad(rows, targets, weights, loaded, causal=True, normalizer=max(n_targets, 1))


def _pad(
    rows: list[list[int]],
    targets: list[list[int]],
    weights: list[list[float]],
    loaded: LoadedModel,
    causal: bool,
    normalizer: float,
    layouts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> TrainBatch:
    """Right-pads the rows into one batch. A row's ``layouts`` entry, when given, is its own
    (positions, attention mask); other rows get 0, 1, 2, … and full (or causal) attention."""
    width = max(map(len, rows))
    b = len(rows)
    ids = torch.full((b, width), loaded.mask_id, dtype=torch.long)
    tgt = torch.full((b, width), -100, dtype=torch.long)
    wts = torch.zeros((b, width))
    valid = torch.zeros((b, width), dtype=torch.bool)
    for i, (r, t, w) in enumerate(zip(rows, targets, weights, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        tgt[i, : len(t)] = torch.tensor(t)
        wts[i, : len(w)] = torch.tensor(w)
        valid[i, : len(r)] = True
    mask = valid[:, None, None, :].expand(b, 1, width, width).clone()
    if causal:
        mask &= torch.ones(width, width, dtype=torch.bool).tril()
    positions = torch.arange(width).expand(b, width).contiguous()
    for i, layout in enumerate(layouts or ()):
        if layout is not None:
            n = len(layout[0])
            positions[i, :n] = layout[0]
            mask[i, 0, :n, :n] = layout[1]
    return TrainBatch(ids, positions, mask, tgt, wts, float(normalizer))


def by_length(batch: TrainBatch) -> tuple[TrainBatch, TrainBatch] | tuple[TrainBatch]:
    """The batch's rows in two batches, short and long, each padded only to its own longest
    row; pooled by :func:`loss` they give exactly the batch's loss (the normalizer stays with
    the first). A row after a system prompt and earlier turns is several times as long as a
    bare question, and padding every row to it would cost most of a step's compute.

    The split point minimises the padded size; a row's length is its own tokens (the diagonal
    of its attention mask, which every layout keeps and padding never has)."""
    lengths = batch.attn_mask[:, 0].diagonal(dim1=-2, dim2=-1).sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ranked = [lengths[i] for i in order]
    n = len(ranked)
    _, k = min((i * ranked[i - 1] + (n - i) * ranked[-1], i) for i in range(1, n + 1))
    if k == n:
        return (batch,)

    def part(rows: list[int], normalizer: float) -> TrainBatch:
        width = max(lengths[i] for i in rows)
        index = torch.tensor(rows)
        return TrainBatch(
            batch.input_ids[index, :width],
            batch.positions[index, :width],
            batch.attn_mask[index, :, :width, :width],
            batch.targets[index, :width],
            batch.weights[index, :width],
            normalizer,
        )

    return part(order[:k], batch.normalizer), part(order[k:], 0.0)


@dataclass(slots=True)
class ConsistencyPair:
    """The same questions asked after their context (``after``) and alone (``alone``): row
    ``i`` of each, built from one random state, differs only in its prompt, so the two rows'
    predicted positions correspond one to one. :func:`loss` adds ``weight`` times the mean
    over those positions of KL(p_alone || p_after), the alone prediction held fixed: a
    context is to change nothing the model would answer without it, its wrong answers
    included, which the cross-entropy towards the right answer alone does not ask."""

    after: TrainBatch
    alone: TrainBatch
    weight: float

    def to(self, device: str | torch.device) -> ConsistencyPair:
        return ConsistencyPair(self.after.to(device), self.alone.to(device), self.weight)


def consistency_pair(
    make: Callable[[list[Example], random.Random], TrainBatch],
    examples: list[Example],
    rng: random.Random,
    weight: float,
) -> ConsistencyPair:
    """``examples`` (each with a context) through the objective's batch builder ``make``
    twice, with the context and without, from one seed: the builders' random draws (cuts,
    mask ratios, padding) depend on the answers only, which the context leaves alone."""
    seed = rng.getrandbits(64)
    after = make(examples, random.Random(seed))
    alone = make([replace(ex, context=()) for ex in examples], random.Random(seed))
    counts = [(b.targets != -100).sum(-1).tolist() for b in (after, alone)]
    if counts[0] != counts[1]:  # a builder whose draws depend on the prompt cannot pair rows
        raise ValueError("the rows with and without context predict different positions")
    return ConsistencyPair(after, alone, weight)


def _predictions(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Logits at the batch's predicted positions, row by row, left to right."""
    hidden = model(batch.input_ids, batch.positions, batch.attn_mask)
    return model.lm_head(hidden[batch.targets != -100]).float()


def loss(model: torch.nn.Module, *parts: TrainBatch | ConsistencyPair) -> torch.Tensor:
    """Weighted cross-entropy of one batch, or of several (each its own forward) pooled as
    one: the sum over all of them over the sum of their normalizers; plus the consistency
    term of each :class:`ConsistencyPair` among ``parts``."""
    total, extra = 0.0, 0.0
    batches = [p for p in parts if isinstance(p, TrainBatch)]
    for batch in batches:
        logits = _predictions(model, batch)
        keep = batch.targets != -100
        ce = F.cross_entropy(logits, batch.targets[keep], reduction="none")
        total = total + (ce * batch.weights[keep]).sum()
    for pair in parts:
        if isinstance(pair, ConsistencyPair):
            with torch.no_grad():
                alone = F.log_softmax(_predictions(model, pair.alone), -1)
            after = F.log_softmax(_predictions(model, pair.after), -1)
            kl = F.kl_div(after, alone, log_target=True, reduction="batchmean")
            extra = extra + pair.weight * kl
    return (total / sum(b.normalizer for b in batches) if batches else 0.0) + extra
