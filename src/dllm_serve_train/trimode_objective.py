"""The tri-mode (Nemotron-Labs-Diffusion) training objective: one row, two views.

Nemotron-Labs-Diffusion trains one set of weights jointly: a causal next-token loss (the AR
view) plus a block-diffusion loss (the diffusion view), ``ar_loss_weight · L_AR +
dlm_loss_weight · L_DLM`` (config keys of the release; ``1.0`` and ``null`` = 1 there). The
training layout is its ``block_diff`` dual stream, which this builds per example:

- **clean stream** ``prompt + answer + EOS``: causal attention, logit shift (position ``j``
  predicts ``j + 1``) — the AR loss on every answer token;
- **noisy block** of ``B`` tokens at the rotary positions of answer tokens ``c … c + B − 1``:
  it attends to the clean stream's tokens left of ``c`` (a causal prefix, exactly the K/V the
  serving modes cache and refresh) and bidirectionally to itself; its first token is the clean
  *seed* ``answer[c]`` (the AR prediction that starts every ``diffusion`` block and every
  ``linear_spec`` round), the rest is masked — all of it (a LinearSpec draft) or at a random
  ratio ``t ~ U(0, 1)`` (a ``diffusion`` block part-way through denoising). Masked positions
  predict their own token (no shift): the DLM loss. Past the answer the block holds EOS
  padding, as the diffusion view sees after the end.

No position sees a token it predicts: the clean stream never attends to the block.
"""

from __future__ import annotations

import random

import torch

from dllm_serve.models.loader import LoadedModel
from dllm_serve_train.objectives import TrainBatch, _pad, encode
from dllm_serve_train.tasks import Example


def two_view_row(
    prompt: list[int],
    answer: list[int],
    cut: int,
    block: list[int],
    masked: list[bool],
    mask_id: int,
) -> tuple[list[int], list[int], list[int], torch.Tensor, torch.Tensor]:
    """``(row, AR targets, DLM targets, positions, attention mask)`` of one example whose noisy
    block (``block``: the true tokens at answer positions ``cut …``) starts at ``cut``."""
    p, n, b = len(prompt), len(answer), len(block)
    clean = prompt + answer
    row = clean + [mask_id if m else tok for tok, m in zip(block, masked, strict=True)]
    ar = [-100] * (p - 1) + answer + [-100] * (1 + b)  # logit shift on the clean stream
    dlm = [-100] * (p + n) + [tok if m else -100 for tok, m in zip(block, masked, strict=True)]
    positions = torch.cat((torch.arange(p + n), torch.arange(p + cut, p + cut + b)))
    allowed = torch.zeros(p + n + b, p + n + b, dtype=torch.bool)
    allowed[: p + n, : p + n] = torch.ones(p + n, p + n, dtype=torch.bool).tril()
    allowed[p + n :, : p + cut] = True  # the causal prefix left of the block
    allowed[p + n :, p + n :] = True  # the block, bidirectionally
    return row, ar, dlm, positions, allowed


def trimode_batch(
    loaded: LoadedModel,
    examples: list[Example],
    rng: random.Random,
    block_size: int,
    draft_share: float = 0.5,
    ar_weight: float = 1.0,
    dlm_weight: float = 1.0,
    lora_stage: bool = False,
) -> TrainBatch:
    """A batch of :func:`two_view_row` rows; the loss is ``ar_weight`` × the mean AR
    cross-entropy + ``dlm_weight`` × the mean over masked block positions.

    ``draft_share`` of the blocks are LinearSpec drafts (seed + all MASK), the others are
    masked at a random ratio. The block starts at the first answer token three times in ten
    (the first ``diffusion`` block and the first LinearSpec round), elsewhere uniformly.
    ``lora_stage``: the draft LoRA's stage — DLM loss on drafts only, no AR loss; the batch's
    ``weights`` are then nonzero only on block positions, which is also where the caller
    applies the LoRA (:func:`block_positions`).
    """
    rows, ar_targets, dlm_targets, layouts = [], [], [], []
    for ex in examples:
        prompt, answer = encode(loaded, ex)
        cut = 0 if rng.random() < 0.3 else rng.randrange(len(answer))
        block = (answer + [loaded.eos_id] * block_size)[cut : cut + block_size]
        if lora_stage or rng.random() < draft_share:
            masked = [i > 0 for i in range(block_size)]
        else:
            t = rng.random()
            masked = [i > 0 and rng.random() < t for i in range(block_size)]
            if not any(masked):
                masked[rng.randrange(1, block_size)] = True
        row, ar, dlm, positions, allowed = two_view_row(
            prompt, answer, cut, block, masked, loaded.mask_id
        )
        rows.append(row)
        ar_targets.append([-100] * len(ar) if lora_stage else ar)
        dlm_targets.append(dlm)
        layouts.append((positions, allowed))
    n_ar = sum(t != -100 for tgt in ar_targets for t in tgt)
    n_dlm = sum(t != -100 for tgt in dlm_targets for t in tgt)
    targets, weights = [], []
    for ar, dlm in zip(ar_targets, dlm_targets, strict=True):
        targets.append([a if a != -100 else d for a, d in zip(ar, dlm, strict=True)])
        weights.append(
            [ar_weight / max(n_ar, 1) if a != -100 else dlm_weight / max(n_dlm, 1) for a in ar]
        )
    return _pad(rows, targets, weights, loaded, False, 1.0, layouts)


def block_positions(batch: TrainBatch, block_size: int) -> torch.Tensor:
    """``[B, L]`` bool: each row's noisy block (the last ``block_size`` tokens before its
    padding) — the tokens a draft forward computes in the draft LoRA's weight view."""
    valid = batch.positions.new_zeros(batch.positions.shape, dtype=torch.bool)
    lengths = batch.attn_mask[:, 0].diagonal(dim1=-2, dim2=-1).sum(-1)  # a row's own tokens
    for i, n in enumerate(lengths.tolist()):
        valid[i, n - block_size : n] = True
    return valid
