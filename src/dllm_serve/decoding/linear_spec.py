"""LinearSpec: self-speculation of a tri-mode model (Nemotron-Labs-Diffusion), exact.

One set of weights, two views (``models/families/nemotron.py``): the diffusion view
(bidirectional, logits at ``i`` predict token ``i``) drafts a whole block at once, the causal
view (logits at ``i`` predict token ``i + 1``) verifies it. Per request:

1. **Prefill** (causal): the prompt's K/V are cached; its last logits give the *seed* ``s``,
   the first answer token (emitted now; its K/V are not cached yet).
2. **Draft** (one forward, diffusion view, the draft LoRA's weights when one is loaded): the
   block ``[s, M × (B − 1)]`` at the next positions attends to the cached prefix and to
   itself; the masks' argmaxes (mask id excluded) are the drafts ``d_1 … d_{B−1}``. Nothing
   of this forward is kept: its K/V slots are overwritten by the verify.
3. **Verify** (the next forward, causal view, base weights): ``[s, d_1 … d_{B−1}]``. Its
   logits at ``i`` give ``a_i``, the model's own next token after ``s, d_1 … d_i``. The first
   ``c`` drafts with ``d_{i+1} = a_i`` are accepted; the round emits ``a_0 … a_c`` (the
   accepted drafts and one bonus token) and keeps the K/V of ``s, d_1 … d_c`` only (the KV
   span's length grows by ``c + 1``; the rejected suffix is overwritten later). ``a_c``
   becomes the next seed, and the next round drafts from it.

Why this is exact. Every emitted token ``a_i`` (``i ≤ c``) is read at a position whose causal
context is exactly the committed prefix: the drafts before it were accepted, i.e. equal the
tokens emitted before it, and every cached K/V was computed causally from committed tokens.
So at T = 0 (``a_i`` = argmax) the answer is token for token that of ``ar`` decoding, whatever
the drafts; at T > 0 each ``a_i`` is *sampled* from the causal distribution at its position
and a draft is accepted iff it equals that sample ("sample-and-match"): every emitted token is
an exact sample of the AR model's next-token distribution given the emitted prefix, and the
drafts only decide how many of them one forward yields (a draft ``x`` matches with
probability ``p(x)``). Drafts are argmaxes at every temperature: under sample-and-match the
most likely draft is the one that matches most often when the draft view agrees with the
causal one (the remote code samples them at T > 0, which is as exact and accepts less).

Block-size tiers (``params.py``) may shrink ``B`` under load between rounds: exactness
does not depend on ``B``. A round never drafts past ``max_tokens``; with one token left it
skips the draft forward (a verify of ``[s]`` is one AR step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm_serve.decoding.grammar import TokenGrammar, request_constraint
from dllm_serve.decoding.params import DecodingParams, request_stop_ids
from dllm_serve.decoding.protocol import (
    AttentionKind,
    RowSpec,
    ShardedLogits,
    StepLogits,
    StepResult,
    as_step_logits,
)
from dllm_serve.decoding.sampler import (
    dense_rows,
    greedy_tokens,
    new_generator,
    sample_inverse_cdf,
    target_probs,
    writable,
)
from dllm_serve.decoding.selfspec import (
    SelfSpecState,
    accepted_prefix,
    constrain_verify_rows,
    split_constrained,
)

PREFILL, DRAFT, VERIFY = "prefill", "draft", "verify"


@dataclass(slots=True, eq=False)
class LinearSpecState(SelfSpecState):
    """One LinearSpec request (lives in the engine's Request); the shared fields, counters and
    :meth:`~SelfSpecState.emit` are :class:`SelfSpecState`'s.

    - ``phase``: what the next forward does (prefill, draft or verify).
    - ``seed``: the last emitted token, whose K/V are not cached yet; ``specs``: this round's
      drafts (``width − 1`` of them, empty before the draft forward).
    - ``kv.length`` always covers the causal K/V of ``prompt + emitted[:-1]``.

    ``nfe`` counts the prefill, then two forwards per round; ``rounds`` verified blocks.
    """

    phase: str = PREFILL
    seed: int = -1
    width: int = 0  # the block B of the current round (seed + drafts)
    # The widest block a round may use (the largest tier's): the block itself follows the
    # engine's load, so the scheduler budgets the widest draft row the next round can be.
    max_block: int = 1

    @property
    def is_prefill(self) -> bool:
        return self.phase == PREFILL

    @property
    def row_length(self) -> int:
        """At most the tokens of the next row: the prompt, a draft row of the widest block that
        is left (exact without tiers), or the verify row of this round's block."""
        if self.phase == PREFILL:  # the prompt past a prefix-cache hit
            return len(self.prompt_ids) - (self.kv.length if self.kv is not None else 0)
        if self.phase == DRAFT:
            return max(1, min(self.max_block, self.params.gen_length - self.generated))
        return max(self.width, 1)


class LinearSpecDecoder:
    """LinearSpec, batched (see the module docstring): :meth:`prepare` → forward →
    :meth:`sample` (tensor in, tensor out) → one device→host copy → :meth:`commit`.

    ``block_size`` is the default B (the checkpoint's block); ``block_for`` (optional) maps the
    engine's load to B (block-size tiers) and ``max_block`` sizes each request's KV
    reservation. The decoder holds configuration only.
    """

    decoding_mode = "self_speculation"

    def __init__(
        self,
        mask_id: int,
        stop_ids: Sequence[int],
        *,
        block_size: int,
        block_for: Callable[[], int] | None = None,
        max_block: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("the LinearSpec block must be >= 1")
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.block_size = block_size
        self.block_for = block_for
        self.max_block = max(block_size, max_block or block_size)
        # Structured output (set by the registry): the verify and prefill positions are
        # masked by the grammar along the drafts (selfspec.constrain_verify_rows).
        self.grammar: TokenGrammar | None = None

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> LinearSpecState:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("LinearSpec needs a non-empty prompt (its last token gives the seed)")
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        return LinearSpecState(
            prompt_ids=prompt,
            params=params,
            generator=new_generator(params, device),
            stop_ids=stop_ids,
            max_block=self.max_block,
            constraint=request_constraint(self.grammar, params.grammar, stop_ids),
        )

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """Prompt + answer + the widest block (a verify writes up to B − 1 slots past it)."""
        return prompt_len + params.gen_length + self.max_block

    # Prefix reuse (protocol.PrefixReuse): the kept K/V are the causal (verify) view's; a
    # draft forward only ever writes past the kept length.
    prefix_alignment = 1

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """All of the prompt but its last token, whose logits give the seed."""
        return prompt_len - 1

    def reuse_prefix(self, state: LinearSpecState, tokens: int) -> None:
        """Nothing to change: the prefill forwards the prompt past ``kv.length``."""
        assert state.kv is not None and state.kv.length == tokens and state.phase == PREFILL

    def _next_width(self, state: LinearSpecState) -> int:
        """B for the next round: the tier's (or default) block, capped by the tokens left (a
        round emits at most B tokens)."""
        b = self.block_size if self.block_for is None else self.block_for()
        return max(1, min(b, state.params.gen_length - state.generated))

    def prepare(self, state: LinearSpecState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        kv = state.kv
        if state.phase == PREFILL:  # the prompt past what the span holds (a prefix hit)
            done, last = kv.length, len(state.prompt_ids) - 1
            return RowSpec(state.prompt_ids[done:], done, [last - done], AttentionKind.CAUSAL, kv)
        if state.phase == DRAFT:
            state.width = self._next_width(state)
            if state.width == 1:  # nothing to draft: this round is one AR step
                state.phase, state.specs = VERIFY, []
            else:
                tokens = [state.seed] + [self.mask_id] * (state.width - 1)
                offsets = list(range(1, state.width))  # no shift: logits at i predict i
                return RowSpec(tokens, kv.length, offsets, AttentionKind.BIDIRECTIONAL, kv,
                               draft=True)  # fmt: skip
        tokens = [state.seed, *state.specs]
        return RowSpec(tokens, kv.length, list(range(len(tokens))), AttentionKind.CAUSAL, kv)

    def sample(
        self, states: Sequence[LinearSpecState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """Tokens ``[R, M]``: argmaxes (mask id excluded) of every requested position; the
        causal positions of rows at T > 0 are exact samples instead. ``logits`` are consumed
        (the mask id's entries are overwritten in place)."""
        logits = writable(as_step_logits(logits))  # greedy_tokens writes in place
        split = split_constrained(states, logits, self.sample)  # tensor parallelism
        if split is not None:
            return split
        # Structured output: the causal positions (prefill seed, verify) under the grammar
        # along the drafts; draft rows stay free (a draft is checked when verified).
        logits = constrain_verify_rows(states, logits)
        sampling = [
            r for r, s in enumerate(states) if s.params.temperature > 0 and s.phase != DRAFT
        ]
        full = dense_rows(logits, sampling)  # the whole distribution (gathered when sharded)
        best = greedy_tokens(logits, self.mask_id)
        for r, z in full.items():
            state = states[r]
            n = 1 if state.phase == PREFILL else len(state.specs) + 1
            probs = target_probs(z[:n], state.params.temperature, self.mask_id)
            best[r, :n] = sample_inverse_cdf(probs, state.generator)
        return best

    def commit(
        self, states: Sequence[LinearSpecState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [self._commit_row(s, row) for s, row in zip(states, host, strict=True)]

    def _commit_row(self, state: LinearSpecState, row: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        state.nfe += 1
        if state.phase == DRAFT:
            state.specs = [int(t) for t in row[: state.width - 1]]
            state.phase = VERIFY
            return StepResult(committed=0, finished=False)
        if state.phase == PREFILL:
            state.kv.length = len(state.prompt_ids)
            emitted, c = [int(row[0])], 0
        else:
            ar = [int(t) for t in row[: len(state.specs) + 1]]
            specs = state.specs
            c = accepted_prefix(specs, ar)
            # Keep the seed and the accepted drafts: their K/V came from committed tokens.
            state.kv.length += 1 + c
            state.rounds += 1
            state.drafted += len(specs)
            emitted = ar[: c + 1]
        result = state.end_round(emitted, c)
        state.specs = []
        if not state.finished:
            state.seed = emitted[-1]
            state.phase = DRAFT
        return result
