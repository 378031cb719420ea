"""Fast-dLLM v2's official ``generate`` loop, without a KV cache, at T = 0 (test helper).

Written from the released ``modeling.py`` (``Fast_dLLM_QwenForCausalLM.generate``), with every
forward a full one over the canvas up to the end of the active block under the block-causal
mask (a cached forward of the block is that, restricted to the block's rows):

1. A prompt holding whole blocks is forwarded once; if it ends on a block boundary, the argmax
   of its last logit is appended: the first answer token.
2. Each block: pad the canvas with masks to the end of the block. For each sub-block of 8, left
   to right, while it has masks: forward; shift the block's logits right by one (position j
   reads output j − 1; position 0 its own); at the sub-block's masked positions take the
   argmax and its probability; commit those with probability > threshold, and always the most
   probable one.
3. A block without masks is forwarded once more and the argmax of its last logit is appended:
   the first token of the next block.

The answer is cut at the first stop id; the loop ends when a stop id has no mask before it.
Two deviations, both as the engine does: the mask id is excluded from the distribution (the
official loop would commit it and never finish), and a prompt of exactly one block is
prefilled like longer ones (the official test is ``len(prompt) > block``, after which it
denoises the first answer block without the prompt in context). The answer budget is
``gen_length`` tokens, where the official loop counts whole blocks.

``steps`` (not in the official loop) is the engine's top-k rule: each sub-block's masks are
committed over ``min(steps·8/block, masks)`` steps, the most probable first, ``masks/steps``
per step as evenly as possible (earlier steps take the remainder).
"""

from __future__ import annotations

import torch

from dllm_serve.models.loader import LoadedModel

SUB_BLOCK = 8


@torch.no_grad()
def reference(
    loaded: LoadedModel,
    prompt: list[int],
    gen_length: int,
    *,
    threshold: float = 1.0,
    steps: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[int], list[int]]:
    """(answer tokens, tokens committed by each forward, prefill and block writes included)."""
    model, mask, b = loaded.model, loaded.mask_id, loaded.block_size
    assert b is not None and b % SUB_BLOCK == 0
    stops = (*loaded.stop_ids, *stop_ids)
    x = list(prompt)
    commits: list[int] = []

    def logits(end: int) -> torch.Tensor:
        """Block-causal forward over ``x[:end]``: fp64 logits ``[end, V]``, mask id excluded."""
        pos = torch.arange(end)
        allowed = (pos[None, :] // b) <= (pos[:, None] // b)
        hidden = model(torch.tensor([x[:end]]), pos[None], allowed[None, None])
        z = model.lm_head(hidden[0]).double()
        z[:, mask] = -float("inf")
        return z

    def done() -> tuple[list[int], bool]:
        """The committed answer within budget, cut at a stop; whether decoding is over."""
        out = []
        for token in x[len(prompt) : len(prompt) + gen_length]:
            if token == mask:
                return out, False
            if token in stops:
                return out, True
            out.append(token)
        return out, len(out) == gen_length

    if len(prompt) >= b:
        z = logits(len(prompt) // b * b)
        if len(prompt) % b == 0:
            x.append(int(z[-1].argmax()))
        commits.append(len(x) - len(prompt))
    while True:
        answer, over = done()
        if over:
            return answer, commits
        lo = len(x) // b * b  # the block the committed canvas ends in
        hi = lo + b
        x += [mask] * (hi - len(x))
        for sub in range(lo, hi, SUB_BLOCK):
            span = range(sub, sub + SUB_BLOCK)
            masked = [p for p in span if x[p] == mask]
            quotas = _quotas(len(masked), steps, b)
            while masked:
                z = logits(hi)[lo:hi]
                shifted = torch.cat([z[:1], z[:-1]])  # output j - 1 predicts position j
                probs = torch.softmax(shifted[[p - lo for p in masked]], dim=-1)
                conf, x0 = probs.max(dim=-1)
                best = int(conf.argmax())  # the first most probable position
                if quotas is None:
                    chosen = {i for i in range(len(masked)) if conf[i] > threshold} | {best}
                else:
                    order = sorted(range(len(masked)), key=lambda i: (-float(conf[i]), i))
                    chosen = set(order[: quotas.pop(0)])
                for i in chosen:
                    x[masked[i]] = int(x0[i])
                commits.append(len(chosen))
                masked = [p for p in span if x[p] == mask]
                answer, over = done()
                if over:
                    return answer, commits
        x.append(int(logits(hi)[-1].argmax()))  # the write forward: next block's first token
        commits.append(1)


def _quotas(masks: int, steps: int | None, block: int) -> list[int] | None:
    """Top-k commits per step for a sub-block of ``masks`` masks (None: the threshold rule)."""
    if steps is None or masks == 0:
        return None
    n = min(max(1, steps * SUB_BLOCK // block), masks)
    return [masks // n + (1 if i < masks % n else 0) for i in range(n)]
