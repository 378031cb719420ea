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

KV lifecycle: the forward writes the K/V of every token of the row into the request's KV-pool
span; after the verdict the span's kept length covers ``pending`` and the accepted specs only,
so it always holds exactly ``prompt + emitted[:-1]`` (length ``len(prompt) + len(emitted) − 1``)
computed causally from committed tokens; the rejected specs' and the MASKs' slots are simply
overwritten by the next round. That, and MASKs sitting after every clean position under causal
attention, is why greedy ISD is token-identical to greedy AR of the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec, StepResult
from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.isd_state import ISDState
from dllm_serve.decoding.isd_verify import greedy_tokens, sample, target_probs, verify_row
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampling import new_generator
from dllm_serve.decoding.sharded_vocab import ShardedLogits, dense_rows, writable
from dllm_serve.decoding.stops import request_stop_ids

__all__ = ["DraftHook", "ISDState", "ISDecoder"]

# Test hook: (state, drafts) -> replacement drafts for the slots after the new pending token.
DraftHook = Callable[[ISDState, list[int]], list[int]]


class ISDecoder:
    """The ISD algorithm, batched: :meth:`prepare` (host) → forward → :meth:`sample` (tensor in,
    tensor out, no value read back) → one device→host copy by the caller → :meth:`commit`.

    ``stride`` is the default N. ``stride_for`` (optional) maps the engine's current load to
    the active N (block-size tiers); the stride may change between rounds of one request,
    which is harmless because verification is exact for any number of specs. ``max_stride``
    sizes each request's KV reservation (the largest tier). The decoder holds configuration
    only; all mutable state, including the generator, lives in :class:`ISDState`.

    ``sample`` returns ``[R, 1 + M]`` per row: greedy rows ``[-1, argmax of each of their
    K + N logits rows…]`` (the host compares the argmaxes with the specs it holds); sampled
    rows ``[j, corrections(K)…, draws(N)…]`` with ``j`` the number of specs accepted.
    """

    decoding_mode = "self_speculation"

    def __init__(
        self,
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
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.stride = stride
        self.stride_for = stride_for
        self.max_stride = max(stride, max_stride or stride)
        self.draft_hook = draft_hook

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> ISDState:
        """A request's state; its KV span (:meth:`kv_tokens` slots) is attached by the engine."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("ISD needs a non-empty prompt (its last token predicts the first)")
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        if self.draft_hook is not None and params.temperature > 0:
            # Forced drafts are not samples of their q; the sampling rule would not be exact.
            raise ValueError("forced drafts are for greedy decoding only")
        return ISDState(
            prompt_ids=prompt,
            params=params,
            generator=new_generator(params, device),
            stop_ids=stop_ids,
            pending=list(prompt),
            device=torch.device(device),
            max_stride=self.max_stride,
        )

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """Slots for prompt + answer + the widest round (K specs and N − 1 masks past them)."""
        return prompt_len + params.gen_length + 2 * self.max_stride

    def active_stride(self, state: ISDState) -> int:
        """N for the next round: the tier's (or default) stride, capped by the tokens left."""
        n = self.stride if self.stride_for is None else self.stride_for()
        # A round emits at most K + 1 ≤ N tokens; drafts past max tokens would be wasted work.
        return max(1, min(n, state.params.gen_length - state.generated))

    def prepare(self, state: ISDState) -> RowSpec:
        """The row ``[pending…, specs, M × (N−1)]``; logits at the K + N rows that matter."""
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        n = self.active_stride(state)
        k = min(len(state.specs), n - 1)
        if k < len(state.specs):  # the stride shrank: verify fewer specs (still exact)
            state.specs = state.specs[:k]
            if state.draft_q is not None:
                state.draft_q = state.draft_q[:k]
        state.round_shape = (k, n)
        first = len(state.pending) - 1  # the row that predicts spec_0 (or the clean token)
        return RowSpec(
            tokens=state.pending + state.specs + [self.mask_id] * (n - 1),
            start=state.kv.length,
            logits_at=list(range(first, first + k + n)),
            attention=AttentionKind.CAUSAL,
            kv=state.kv,
        )

    def sample(
        self, states: Sequence[ISDState], logits: torch.Tensor | ShardedLogits
    ) -> torch.Tensor:
        """Every row's verdict material ``[R, 1 + M]`` (see the class docstring); ``logits``
        are consumed (the mask id's entries are overwritten in place)."""
        rows = logits.shape[0]
        logits = writable(logits)  # greedy_tokens writes in place
        # The rows that sample need the whole distribution (gathered when sharded).
        full = dense_rows(logits, [r for r, s in enumerate(states) if s.params.temperature > 0])
        best = greedy_tokens(logits, self.mask_id)  # [R, M]: one argmax for every row
        out = torch.cat([best.new_full((rows, 1), -1), best], dim=1)
        for r, z in full.items():
            state = states[r]
            k, n = state.round_shape
            probs = target_probs(z[: k + n], state.params.temperature, self.mask_id)
            drawn = sample(probs[k:], state.generator)  # the clean token and the new drafts
            if k:
                assert state.draft_q is not None, "sampled specs without their draft distribution"
                specs = to_device(state.specs, best.device)
                accepted, corrections = verify_row(probs[:k], state.draft_q, specs, state.generator)
            else:
                accepted, corrections = best.new_zeros(()), best.new_zeros(0)
            out[r, : 1 + k + n] = torch.cat([accepted[None], corrections, drawn])
            # clone(): keep only the N−1 draft rows alive, not the whole [K + N, V] block.
            state.next_q = probs[k + 1 :].clone()
        return out

    def commit(
        self, states: Sequence[ISDState], verdicts: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        """Emit, trim the KV and check stops for every row (host lists from :meth:`sample`)."""
        return [self._commit_row(s, v) for s, v in zip(states, verdicts, strict=True)]

    def _commit_row(self, state: ISDState, verdict: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        k, n = state.round_shape
        specs = state.specs
        if verdict[0] < 0:  # greedy: accept spec_i iff it is the argmax
            best = verdict[1 : 1 + k + n]
            j = next((i for i in range(k) if specs[i] != best[i]), k)
            emitted = [*specs[:j], best[j]]
            drafts = best[k + 1 : k + n] if j == k else None
            draft_q = None
        else:
            j = verdict[0]
            emitted = [*specs[:j], verdict[1 + j] if j < k else verdict[1 + k]]
            drafts = verdict[2 + k : 1 + k + n] if j == k else None
            draft_q = state.next_q if j == k else None
        state.next_q = None
        # Keep pending + accepted specs; the rejected suffix and the MASKs are not kept.
        state.kv.length += len(state.pending) + j
        state.nfe += 1
        state.rounds += 1
        state.drafted += k
        before = len(state.emitted)
        committed = state.emit(emitted)
        # The accepted specs the answer used: none past a stop id or max tokens.
        state.accepted_drafts += min(j, committed)
        new = len(state.emitted) - before
        if state.finished:
            state.specs, state.draft_q = [], None
            return StepResult(committed, True, state.finish_reason, new_tokens=new)
        state.pending = [emitted[-1]]
        state.specs = list(drafts) if drafts is not None else []
        state.draft_q = draft_q
        if self.draft_hook is not None and state.specs:
            state.specs = list(self.draft_hook(state, list(state.specs)))
        return StepResult(committed, False, new_tokens=new)

    def update(self, state: ISDState, logits: torch.Tensor) -> StepResult:
        """:meth:`sample` + :meth:`commit` for one row, ``logits`` ``[K + N, V]``."""
        if state.finished:
            raise RuntimeError("update() called on a finished request")
        if state.kv is None:
            raise RuntimeError("update() called on a request without its KV span")
        k, n = state.round_shape
        if logits.dim() != 2 or logits.shape[0] != k + n:
            raise ValueError(f"expected logits [{k + n}, V], got {tuple(logits.shape)}")
        return self.commit([state], self.sample([state], logits[None].clone()).tolist())[0]
