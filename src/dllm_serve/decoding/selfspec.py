"""Self-speculation (I-DLM's introspective strided decoding, and what LinearSpec shares with
it): a round drafts future tokens and verifies them causally, and only verified tokens are
emitted, so the answer is exactly what causal decoding of the same weights gives.

**Introspective strided decoding (ISD).**
One round of a request is one row of one causal forward over

    [pending…, spec_0 … spec_{K-1}, M × (N−1)]        (K ≤ N−1 drafts from the last round)

at positions continuing the request's KV cache. ``pending`` is the prompt on the first round
(the prefill is fused into the first cold start) and afterwards the one emitted token whose
KV is not cached yet. With the I-DLM logit shift, the output at position ``i`` predicts token
``i + 1``: the row of ``pending``'s last token verifies ``spec_0``, the row of ``spec_{i-1}``
verifies ``spec_i``, the row of the last spec gives the *clean* (bonus) token and the N−1 MASK
rows give the next round's drafts. K = 0 is the cold start ``[t0, M…]`` (after the prefill or
after a rejection); N = 1 is plain autoregressive decoding (no masks, no drafts).

Acceptance, left to right (the math: *Verification at T > 0* below):

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

**Verification at T > 0.**
Notation: ``p`` is the target distribution at a verify position (the model's own next-token
distribution given the committed prefix), ``q`` the distribution a draft token ``x`` was
*sampled* from. The rule (Leviathan et al. 2023; Chen et al. 2023):

    accept x with probability a(x) = min(1, p(x) / q(x));
    on rejection, sample from r = max(0, p − q) / Σ max(0, p − q).

The output is distributed exactly as p: P(out = y) = q(y)·a(y) + (1 − Σ_x q(x)a(x))·r(y)
= min(p, q)(y) + (Σ_y max(0, p − q)(y))·r(y) = min(p, q)(y) + max(0, p − q)(y) = p(y),
because Σ_x min(p, q)(x) = 1 − Σ max(0, p − q). This needs ``x ~ q``. The published I-DLM
server takes x = argmax q but still tests min(1, p/q) and resamples from max(0, p − q): that
mix is biased (e.g. p = [.5, .3, .2], q = [.4, .35, .25] always emits token 0), so it is not
offered here; ``tests/unit/decoding/test_decoding_isd_rule.py`` shows the deviation.

All arithmetic is float64 and every random number comes from the request's own generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.grammar import Constraint, TokenGrammar, request_constraint
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
    restrict_to_bitmasks,
    sample,
    sample_split,
    target_probs,
    writable,
)
from dllm_serve.models.attention import to_device
from dllm_serve.models.kv_pool import KVPages

# ---- the state every self-speculative request shares -------------------------------------------


@dataclass(slots=True, eq=False)
class SelfSpecState:
    """One self-speculative request (lives in the engine's Request); subclasses add their own
    round fields (keyword-only where they have no default, so they may follow these).

    - ``kv``: the request's KV-pool span; set by the engine at admission.
    - ``specs``: the drafts this round verifies.
    - ``emitted``: accepted answer tokens, stop id excluded; final as soon as they are here.

    Counters (usage/metrics): ``nfe`` forwards, ``rounds`` verified rounds, ``drafted`` specs
    verified, ``accepted_drafts`` specs accepted *and used* (a round's accepted specs after
    its stop id are not counted, so ``accepted_drafts <= committed``), ``committed`` tokens
    produced including a stop id. ``step`` mirrors ``rounds`` and ``block`` is always 0 so
    the engine's generic counters stay meaningful.
    """

    prompt_ids: list[int]
    params: DecodingParams
    generator: torch.Generator | None
    stop_ids: tuple[int, ...]
    kv: KVPages | None = None
    specs: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    generated: int = 0  # tokens counted against max tokens (gen_length), stop id included
    nfe: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted_drafts: int = 0
    committed: int = 0
    block: int = 0
    finished: bool = False
    finish_reason: str | None = None
    # Requests with logprobs (engine/logprobs.py), on the device: the emitted tokens' entries,
    # and this forward's candidates (the specs' and each row's own token's) until the commit.
    logprob_buffer: torch.Tensor | None = None
    logprob_staged: tuple[torch.Tensor, torch.Tensor] | None = None
    # Structured output: the matcher of the emitted answer (decoding/grammar.py); None: free.
    constraint: Constraint | None = None

    @property
    def step(self) -> int:
        return self.rounds

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens produced per forward (``committed / nfe``; 1 for AR)."""
        return self.committed / self.nfe if self.nfe else 0.0

    def answer_tokens(self) -> list[int]:
        """The accepted answer so far, stop id excluded (every token is final: stream it)."""
        return list(self.emitted)

    def emit(self, tokens: list[int]) -> int:
        """Append accepted tokens one by one, stopping at a stop id or at max tokens.

        Tokens after a stop are dropped even though they were accepted (verified) in the same
        round. Returns how many tokens were consumed (the stop id included).
        """
        consumed = 0
        for token in tokens:
            consumed += 1
            self.generated += 1
            self.committed += 1
            if token in self.stop_ids:
                self.finished, self.finish_reason = True, "stop"
                break
            self.emitted.append(token)
            if self.generated >= self.params.gen_length:
                self.finished, self.finish_reason = True, "length"
                break
        return consumed

    def end_round(self, emitted: list[int], accepted: int) -> StepResult:
        """Emit a verified round's tokens (:meth:`emit`) and count its ``accepted`` drafts:
        only those the answer used, none past a stop id or max tokens."""
        if self.constraint is not None:
            # Every verified token was drawn under its grammar mask (grammar_masks), so the
            # matcher takes them all, up to and including a stop id.
            ends = [i for i, t in enumerate(emitted) if t in self.stop_ids]
            run = emitted[: ends[0] + 1] if ends else emitted
            kept = self.constraint.accept(run)
            if kept != len(run):
                raise RuntimeError("structured output: a verified token broke the grammar")
        before = len(self.emitted)
        committed = self.emit(emitted)
        self.accepted_drafts += min(accepted, committed)
        new = len(self.emitted) - before
        return StepResult(committed, self.finished, self.finish_reason, new_tokens=new)


def grammar_masks(
    constraint: Constraint, specs: Sequence[int], stop_ids: Sequence[int]
) -> list[bytes]:
    """The grammar's allowed-token bitmasks along a chain of drafts: entry ``i`` is what may
    follow the emitted answer and ``specs[:i]``, for the verify position of ``spec_i`` (and,
    at ``i = len(specs)``, the clean token after them all). The chain stops after the first
    spec the grammar rejects or a stop id: verification rejects that spec (its target
    probability is 0 under the mask) or ends the answer there, so no later position is used.
    The request's matcher is left as it was."""
    masks = [constraint.allowed_bits()]
    twin: Constraint | None = None
    for spec in specs:
        bits = masks[-1]
        if spec in stop_ids or not (spec >> 3 < len(bits) and bits[spec >> 3] >> (spec & 7) & 1):
            break
        twin = twin or constraint.fork()
        twin.accept([spec])
        masks.append(twin.allowed_bits())
    return masks


def accepted_prefix(specs: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the verifier's tokens at their positions (greedy
    verification, or LinearSpec's sample-and-match)."""
    return next((i for i in range(len(specs)) if specs[i] != targets[i]), len(specs))


# ---- verification ------------------------------------------------------------------------------


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The correction distribution ``max(0, p − q)`` normalised.

    It sums to zero only when p == q, where every draft is accepted and the residual is
    never used; we then return p so the function is total.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return p if float(total) <= 0.0 else r / total


def verify_row(
    p: torch.Tensor, q: torch.Tensor, specs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling check of K drafts ``specs ~ q`` against ``p`` (``[K, V]``),
    with no value read back: ``(accepted, corrections)``.

    ``accepted`` (0-d) is the number of leading drafts that pass ``u_i · q_i(x_i) < p_i(x_i)``
    (``u < a`` without a division; a ≥ 1 always accepts since u < 1). ``corrections`` ``[K]``
    holds a sample of ``residual(p_i, q_i)`` for every i, drawn up front so the generator's
    consumption depends on K alone; only the one at the first rejection is ever used. Every
    random number is independent of the others, so the emitted token is still exactly
    p-distributed.
    """
    k = specs.shape[0]
    rows = torch.arange(k, device=p.device)
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    ok = u * q[rows, specs] < p[rows, specs]
    accepted = ok.long().cumprod(0).sum()
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    corrections = sample(torch.where(total > 0, r / total.clamp_min(1e-300), p), generator)
    return accepted, corrections


# ---- structured output -------------------------------------------------------------------------


def constrain_verify_rows(states: Sequence[SelfSpecState], logits: StepLogits) -> StepLogits:
    """Each constrained row's verify positions (and its clean position) restricted to what its
    grammar allows after the answer and the drafts before them (:func:`grammar_masks`).

    Verification then runs against the grammar-masked target p: at T = 0 a spec is accepted
    iff it is the masked argmax (so a spec the grammar rejects never is, and the correction is
    the masked argmax); at T > 0 speculative sampling against the renormalised masked p is
    exact for it (p = 0 on a rejected spec, and max(0, p − q) keeps p's support), so every
    emitted token is a valid continuation. Draft positions stay unmasked: a draft is only a
    proposal, checked when it is verified.
    """
    at: list[int] = []
    masks: list[bytes] = []
    for r in verify_rows_to_constrain(states):
        state = states[r]
        assert state.constraint is not None
        k, _ = getattr(state, "round_shape", (len(state.specs), 1))
        chain = grammar_masks(state.constraint, state.specs[:k], state.stop_ids)
        at.extend(logits.offsets[r] + i for i in range(len(chain)))
        masks.extend(chain)
    return restrict_to_bitmasks(logits, at, masks) if at else logits


def verify_rows_to_constrain(states: Sequence[SelfSpecState]) -> list[int]:
    """The rows whose causal positions :func:`constrain_verify_rows` masks: constrained,
    unfinished and not a LinearSpec draft row (a draft row proposes only)."""
    return [
        r
        for r, s in enumerate(states)
        if s.constraint is not None and not s.finished and getattr(s, "phase", "") != "draft"
    ]


def split_constrained(
    states: Sequence[SelfSpecState],
    logits: StepLogits,
    sample: Callable[[list[SelfSpecState], StepLogits], torch.Tensor],
) -> torch.Tensor | None:
    """Under tensor parallelism, a self-speculative sampler's result with the constrained
    verify rows' logits gathered whole (the grammar's masks are :func:`constrain_verify_rows`
    on dense logits, then the same verification) and the other rows' left sharded; None
    when there is nothing to split (dense logits, or no constrained verify row)."""
    if logits.sharded is None:
        return None
    gather = verify_rows_to_constrain(states)
    if not gather:
        return None
    # Both parts are as wide as the step's sharded logits (one width for every row), so the
    # fill is never read.
    return sample_split(logits, gather, lambda rows, z: sample([states[r] for r in rows], z), -1)


# ---- ISD ---------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ISDState(SelfSpecState):
    """One request's ISD state (lives in the engine's Request); the shared fields, counters and
    :meth:`~SelfSpecState.emit` are :class:`SelfSpecState`'s.

    - ``kv``: its ``length`` covers exactly the causal K/V of ``prompt + emitted[:-1]``
      (accepted tokens only).
    - ``pending``: tokens whose KV is not cached yet: the prompt before the first round, then
      the last emitted token.
    - ``specs``: drafts for the slots after ``pending``; ``draft_q`` ``[K, V]`` float64 holds
      the distributions they were sampled from (None at T = 0, where drafts are argmaxes).

    ``rounds`` == ``nfe``: one forward per round.
    """

    pending: list[int] = field(kw_only=True)
    device: torch.device = field(kw_only=True)
    draft_q: torch.Tensor | None = None
    next_q: torch.Tensor | None = None  # this round's draft distributions, kept if all accepted
    round_shape: tuple[int, int] = (0, 1)  # (K specs, N stride) of the prepared round
    # The widest stride a round may use (the largest tier's): the stride itself follows the
    # engine's load, so the scheduler budgets the widest row the next round can be.
    max_stride: int = field(default=1, kw_only=True)

    @property
    def is_prefill(self) -> bool:
        """The first round carries the whole prompt (fused with the first cold start)."""
        return self.rounds == 0

    @property
    def row_length(self) -> int:
        """At most the tokens this request's next row puts in a forward: ``pending``, the specs
        a stride of N verifies (at most N − 1) and N − 1 masks, at the widest N that is left
        (exact without tiers, whose stride is the widest)."""
        n = max(1, min(self.max_stride, self.params.gen_length - self.generated))
        return len(self.pending) + min(len(self.specs), n - 1) + n - 1


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
        # Structured output (set by the registry): compiles each request's grammar. None:
        # response_format refused.
        self.grammar: TokenGrammar | None = None

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
            constraint=request_constraint(self.grammar, params.grammar, stop_ids),
        )

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """Slots for prompt + answer + the widest round (K specs and N − 1 masks past them)."""
        return prompt_len + params.gen_length + 2 * self.max_stride

    # Prefix reuse (protocol.PrefixReuse): causal K/V depend on the tokens up to them only.
    prefix_alignment = 1

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """All of the prompt but its last token, whose logits the first round needs."""
        return prompt_len - 1

    def reuse_prefix(self, state: ISDState, tokens: int) -> None:
        """The first round forwards the prompt past the cached ``tokens`` only."""
        assert state.kv is not None and state.kv.length == tokens and state.rounds == 0
        state.pending = state.prompt_ids[tokens:]

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
        self, states: Sequence[ISDState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """Every row's verdict material ``[R, 1 + M]`` (see the class docstring); ``logits``
        are consumed (the mask id's entries are overwritten in place)."""
        logits = writable(as_step_logits(logits))  # greedy_tokens writes in place
        split = split_constrained(states, logits, self.sample)
        if split is not None:
            return split
        logits = constrain_verify_rows(states, logits)
        rows = logits.rows
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
            j = accepted_prefix(specs, best)
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
        result = state.end_round(emitted, j)
        if state.finished:
            state.specs, state.draft_q = [], None
            return result
        state.pending = [emitted[-1]]
        state.specs = list(drafts) if drafts is not None else []
        state.draft_q = draft_q
        if self.draft_hook is not None and state.specs:
            state.specs = list(self.draft_hook(state, list(state.specs)))
        return result

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
