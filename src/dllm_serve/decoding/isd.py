"""Introspective strided decoding (ISD): I-DLM self-speculation with exact verification.

One round of a request is one row of one causal forward over

    [pending…, spec_0 … spec_{K-1}, M × (N−1)]        (K ≤ N−1 drafts from the last round)

at positions continuing the request's KV cache. ``pending`` is the prompt on the first round
(the prefill is fused into the first cold start) and afterwards the one emitted token whose
KV is not cached yet. With the I-DLM logit shift, the output at position ``i`` predicts token
``i + 1``: the row of ``pending``'s last token verifies ``spec_0``, the row of ``spec_{i-1}``
verifies ``spec_i``, the row of the last spec gives the *clean* (bonus) token and the N−1 MASK
rows give the next round's drafts. K = 0 is the cold start ``[t0, M…]`` (after the prefill or
after a rejection); N = 1 is plain autoregressive decoding (no masks, no drafts).

Acceptance, left to right (``decoding/isd_verify.py`` has the math):

- T = 0: accept ``spec_i`` iff it is the argmax; the first mismatch emits the argmax instead.
- T > 0: drafts were *sampled* from their q; accept with ``min(1, p/q)``, else emit a sample
  of the normalised ``max(0, p − q)``; this makes every emitted token exactly p-distributed.

All specs accepted: emit them plus the clean token, keep the new drafts. First rejection at
``j``: emit ``spec_0..spec_{j-1}`` plus the correction, drop the drafts (they were conditioned
on the rejected spec). Either way the last emitted token becomes ``pending``.

KV lifecycle: the forward stores the K/V of ``pending`` and the specs only (``kv_write``), never
of a MASK; after the verdict the cache is cropped to the accepted prefix, so it always holds
exactly ``prompt + emitted[:-1]`` (length ``len(prompt) + len(emitted) − 1``) computed causally
from committed tokens. That, and MASKs sitting after every clean position under causal
attention, is why greedy ISD is token-identical to greedy AR of the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, ForwardSpec, StepResult
from dllm_serve.decoding.isd_state import ISDState
from dllm_serve.decoding.isd_verify import greedy_tokens, sample, target_probs, verify_specs
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.models.kv_cache import KVCache

__all__ = ["DraftHook", "ISDState", "ISDecoder"]

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit
# Test hook: (state, drafts) -> replacement drafts for the slots after the new pending token.
DraftHook = Callable[[ISDState, list[int]], list[int]]


class ISDecoder:
    """The ISD algorithm with the engine's interface (``init_state`` / ``prepare`` / ``update``).

    ``stride`` is the default N. ``stride_for`` (optional) maps the engine's current load to
    the active N (block-size tiers); the stride may change between rounds of one request,
    which is harmless because verification is exact for any number of specs. ``max_stride``
    sizes each request's KV reservation (the largest tier). The decoder holds configuration
    only; all mutable state, including the generator, lives in :class:`ISDState`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mask_id: int,
        stop_ids: Sequence[int],
        *,
        stride: int = 4,
        stride_for: Callable[[], int] | None = None,
        max_stride: int | None = None,
        draft_hook: DraftHook | None = None,
    ) -> None:
        if stride < 1:
            raise ValueError("the ISD stride must be >= 1")
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.model = model
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.stride = stride
        self.stride_for = stride_for
        self.max_stride = max(stride, max_stride or stride)
        self.draft_hook = draft_hook

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> ISDState:
        """State with an empty cache reserved for prompt + answer + the largest round."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("ISD needs a non-empty prompt (its last token predicts the first)")
        if self.mask_id in params.stop_token_ids:
            raise ValueError("the mask id cannot be a stop id")
        if self.draft_hook is not None and params.temperature > 0:
            # Forced drafts are not samples of their q; the sampling rule would not be exact.
            raise ValueError("forced drafts are for greedy decoding only")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=device)
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed % _SEED_MODULUS)
        cache = KVCache.for_model(self.model)  # type: ignore[arg-type]
        cache.reserve(len(prompt) + params.gen_length + self.max_stride)
        return ISDState(
            prompt_ids=prompt,
            params=params,
            generator=generator,
            stop_ids=() if params.ignore_eos else (*self.stop_ids, *params.stop_token_ids),
            cache=cache,
            pending=list(prompt),
            device=torch.device(device),
        )

    def active_stride(self, state: ISDState) -> int:
        """N for the next round: the tier's (or default) stride, capped by the tokens left."""
        n = self.stride if self.stride_for is None else self.stride_for()
        # A round emits at most K + 1 ≤ N tokens; drafts past max tokens would be wasted work.
        return max(1, min(n, state.params.gen_length - state.generated))

    def prepare(self, state: ISDState) -> ForwardSpec:
        """The row ``[pending…, specs, M × (N−1)]``; logits at the K + N rows that matter."""
        if state.finished or state.cache is None:
            raise RuntimeError("prepare() called on a finished request")
        n = self.active_stride(state)
        k = min(len(state.specs), n - 1)
        if k < len(state.specs):  # the stride shrank: verify fewer specs (still exact)
            state.specs = state.specs[:k]
            if state.draft_q is not None:
                state.draft_q = state.draft_q[:k]
        state.round_shape = (k, n)
        tokens = state.pending + state.specs + [self.mask_id] * (n - 1)
        start = state.cache.length
        first = len(state.pending) - 1  # the row that predicts spec_0 (or the clean token)
        return ForwardSpec(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=state.device),
            positions=torch.arange(start, start + len(tokens), device=state.device),
            logits_index=torch.arange(first, first + k + n, device=state.device),
            attention=AttentionKind.CAUSAL,
            kv_cache=state.cache,
            kv_write=len(state.pending) + k,  # never a MASK
        )

    def update(self, state: ISDState, logits: torch.Tensor) -> StepResult:
        """Verify, emit, trim the cache and check stops; ``logits`` is ``[K + N, V]``."""
        if state.finished or state.cache is None:
            raise RuntimeError("update() called on a finished request")
        k, n = state.round_shape
        if logits.dim() != 2 or logits.shape[0] != k + n:
            raise ValueError(f"expected logits [{k + n}, V], got {tuple(logits.shape)}")
        written = len(state.pending) + k
        prefix = state.cache.length - written  # the cache length before this forward
        emitted, drafts, draft_q = self._verdict(state, logits, k)
        accepted = len(emitted) - 1  # specs accepted: all but the clean/correction token
        # Keep pending + accepted specs; drop the rejected suffix (MASKs were never written).
        state.cache.crop(prefix + len(state.pending) + accepted)
        state.nfe += 1
        state.rounds += 1
        state.drafted += k
        state.accepted_drafts += accepted
        committed = self._commit(state, emitted)
        if state.finished:
            state.cache = None  # free the KV at once
            state.specs, state.draft_q = [], None
            return StepResult(committed, True, state.finish_reason)
        state.pending = [emitted[-1]]
        state.specs = drafts if drafts is not None else []
        state.draft_q = draft_q if drafts is not None else None
        if self.draft_hook is not None and state.specs:
            state.specs = list(self.draft_hook(state, list(state.specs)))
        return StepResult(committed, False)

    def _verdict(
        self, state: ISDState, logits: torch.Tensor, k: int
    ) -> tuple[list[int], list[int] | None, torch.Tensor | None]:
        """(tokens emitted this round, new drafts or None after a rejection, their q)."""
        temperature = state.params.temperature
        specs = state.specs
        if temperature == 0:
            # One argmax over all rows, one device→host copy.
            best = greedy_tokens(logits, self.mask_id).tolist()
            for i in range(k):
                if specs[i] != best[i]:
                    return [*specs[:i], best[i]], None, None
            return [*specs, best[k]], best[k + 1 :], None
        probs = target_probs(logits, temperature, self.mask_id)
        if k:
            assert state.draft_q is not None, "sampled specs without their draft distribution"
            j, correction = verify_specs(probs[:k], state.draft_q, specs, state.generator)
            if correction is not None:
                return [*specs[:j], correction], None, None
        # Every spec accepted: the clean token and the new drafts, each a draw from its row.
        drawn = sample(probs[k:], state.generator).tolist()
        # clone(): keep only the N−1 draft rows alive, not the whole [K + N, V] block.
        return [*specs, drawn[0]], drawn[1:], probs[k + 1 :].clone()

    @staticmethod
    def _commit(state: ISDState, tokens: list[int]) -> int:
        """Append accepted tokens one by one, stopping at a stop id or at max tokens.

        Tokens after a stop are dropped even though they were accepted in the same round.
        Returns how many tokens were consumed (the stop id included).
        """
        consumed = 0
        for token in tokens:
            consumed += 1
            state.generated += 1
            state.committed += 1
            if token in state.stop_ids:
                state.finished, state.finish_reason = True, "stop"
                break
            state.emitted.append(token)
            if state.generated >= state.params.gen_length:
                state.finished, state.finish_reason = True, "length"
                break
        return consumed
