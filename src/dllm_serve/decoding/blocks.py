"""Masked diffusion, block by block: the state and the batched step every block decoder shares.

**The shared base.** Every masked-diffusion decoder keeps its canvas on the host as a
:class:`DenoiseState` and denoises one *active block* at a time: each step proposes tokens at
the block's still-masked positions and commits some of them under the request's rule — top-k
on a per-block schedule, the confidence threshold or LocalLeap (``commit_rules.py``). The
batched part of that step is :meth:`BlockDecoder.sample`: tensor in, tensor out, every row
under its own rule. A decoder specialises it by where its blocks sit, what each forward holds
and what its K/V cache keeps: LLaDA/Dream canvas denoising (``canvas.py``), Fast-dLLM v2
(``fast_dllm.py``), a tri-mode model's diffusion mode (``causal_blocks.py``) and block
diffusion itself (``block_diffusion.py``).

The block-diffusion decoder (SDAR/TraDo, LLaDA2.x) is in ``block_diffusion.py``.

**Structured output** (``response_format``): a constrained row's first masked position is
restricted to its grammar's next tokens and always committed, greedy rows propose the most
probable valid fill of the block window, and the host keeps only the valid run of the row's
commits (``structured.py``). Under tensor parallelism the constrained rows' logits are
gathered whole on rank 0 and run this same code; the other rows stay sharded
(``sampler.sample_split``).

The answer is the committed canvas after the prompt, cut at ``max_tokens`` and before the
first stop id; a request ends as soon as the contiguous committed answer holds a stop id
(exact: committed tokens never change) or reaches ``max_tokens``. Blocks past the answer budget
are never started; the last block may hold positions past it, decoded and dropped (the official
loops round their canvas up to whole blocks the same way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import torch

from dllm_serve.decoding.commit_rules import (
    argmax_onehot,
    block_schedule,
    entropy_bound_commit_rows,
    entropy_of_score,
    entropy_threshold_commit_rows,
    local_leap_commit_rows,
    threshold_commit_rows,
    topk_commit_rows,
)
from dllm_serve.decoding.grammar import Constraint, TokenGrammar, request_constraint
from dllm_serve.decoding.params import DecodingParams, request_stop_ids
from dllm_serve.decoding.protocol import (
    ShardedLogits,
    StepLogits,
    StepResult,
    as_step_logits,
)
from dllm_serve.decoding.sampler import (
    dense_rows,
    new_generator,
    propose,
    restrict_to_bitmasks,
    sample_inverse_cdf,
    sample_split,
    seed_tokens,
    target_probs,
)
from dllm_serve.decoding.structured import grammar_run, lookahead_fill, mask_to_grammar
from dllm_serve.models.attention import host_to_device, to_device
from dllm_serve.models.kv_pool import KVPages

PREFILL, DECODE, WRITE = "prefill", "decode", "write"  # block diffusion's phases
CONFIDENCE_SCALE = 1_000_000  # a reported confidence's unit in a step's integer result


@dataclass(slots=True, eq=False)
class DenoiseState:
    """Per-request state of a masked-diffusion decoder (lives in the engine's Request).

    ``tokens`` is the canvas as a host list: the prompt, then the answer region of masks
    (``params.gen_length`` positions, or whole blocks of them). A position of the answer region
    is *committed* once it holds a token other than ``mask_id``; committed tokens never change.
    The host copy is what makes a step cheap: which positions are masked, the block's schedule
    and the contiguous final prefix are known without reading the device, and the one
    device→host copy per step brings back only the tokens committed in it.

    ``kv`` is the request's span in the KV pool when its decoder keeps K/V (None without one);
    ``kv.length`` is the cached prefix.

    Counters for usage and metrics: ``nfe`` (forward passes consumed) and ``committed``
    (canvas tokens committed); :attr:`tokens_per_forward` is their ratio.
    """

    tokens: list[int]
    prompt_len: int
    params: DecodingParams
    generator: torch.Generator | None  # None when temperature == 0
    mask_id: int
    stop_ids: tuple[int, ...]
    block: int = 0  # index of the active block
    step: int = 0  # step index within the active block
    # Transfer counts of the active block in top-k mode; empty in the data-dependent modes.
    schedule: list[int] = field(default_factory=list)
    masked: list[int] = field(default_factory=list)  # active block's masked positions, ascending
    nfe: int = 0  # forward passes consumed
    committed: int = 0  # canvas tokens committed so far
    final_len: int = 0  # contiguous committed answer prefix
    stop_at: int | None = None  # answer index of the first stop id in that prefix
    finished: bool = False
    finish_reason: str | None = None
    kv: KVPages | None = None
    # Leading positions whose K/V came from another request (the prefix cache across requests,
    # canvas denoising behind --kv-cache prefix): never recomputed by this one.
    reused: int = 0
    drafted: int | None = None  # self-speculation counters (not used by diffusion decoding)
    accepted_drafts: int | None = None
    # Masked positions past the active block that a forward includes (None: the whole canvas,
    # the reference loop). A model trained on short canvases sets it (generation_config.json
    # ``mask_lookahead``) so that a long canvas is seen block by block as a short one is.
    mask_lookahead: int | None = None
    # A traced request (the playground): the step's result carries each masked position's
    # confidence after its tokens, for the trace event (see ``BlockDecoder.sample``).
    report_confidence: bool = False
    # Requests with logprobs: per answer position, the committing forward's entry, on the
    # device (engine/logprobs.py); None until the first commit.
    logprob_buffer: torch.Tensor | None = None
    # Structured output: the matcher of the committed answer prefix (decoding/grammar.py);
    # None: free text. A constrained row commits only a left-to-right run of its active block.
    constraint: Constraint | None = None

    @property
    def canvas(self) -> torch.Tensor:
        """The canvas as a 1-D LongTensor (a copy, for inspection and tests)."""
        return torch.tensor(self.tokens, dtype=torch.long)

    @property
    def is_prefill(self) -> bool:
        """Every canvas-denoising step forwards the canvas (prompt included): no prefill."""
        return False

    @property
    def visible_end(self) -> int:
        """End of the canvas the next forward includes: everything, or with a mask lookahead
        the active block and at most ``mask_lookahead`` masks after it. Later positions are
        all still masked (blocks commit left to right), so leaving them out only removes MASK
        keys that the active block would otherwise attend to."""
        if self.mask_lookahead is None:
            return len(self.tokens)
        return min(len(self.tokens), self.active_block[1] + self.mask_lookahead)

    @property
    def row_length(self) -> int:
        """Tokens this request puts in its next forward (the scheduler's token budget)."""
        if self.kv is not None and self.kv.length:
            return self.visible_end - self.kv.length
        return self.visible_end

    @property
    def tokens_per_forward(self) -> float:
        """Canvas tokens committed per forward pass so far (``committed / nfe``; 0 before any).

        Counts every committed canvas token, including EOS/padding the answer later drops; 1.0
        is LLaDA's one-token-per-step regime, higher means parallel commits paid off.
        """
        return self.committed / self.nfe if self.nfe else 0.0

    @property
    def active_block(self) -> tuple[int, int]:
        """Canvas slice ``[lo, hi)`` of the active block (blocks of ``block_length`` after the
        prompt; block decoders align theirs differently)."""
        assert self.params.block_length is not None  # resolved by DecodingParams
        lo = self.prompt_len + self.block * self.params.block_length
        return lo, lo + self.params.block_length

    def advance_final(self) -> int:
        """Extend the contiguous committed prefix after commits; returns how far it moved.

        Every block before the active one is complete, so the scan starts where it stopped;
        the first stop id inside the final prefix is remembered (committed tokens never change,
        so it is final too).
        """
        # The answer region: a canvas may hold more (rounded up to whole blocks), never less.
        budget = self.params.answer_budget
        start = self.final_len
        end = start
        base = self.prompt_len
        tokens, mask_id = self.tokens, self.mask_id
        while end < budget and tokens[base + end] != mask_id:
            if self.stop_at is None and tokens[base + end] in self.stop_ids:
                self.stop_at = end
            end += 1
        self.final_len = end
        return end - start

    def answer_tokens(self) -> list[int]:
        """The final answer so far: the contiguous committed prefix, cut before the first stop id.

        Everything returned is final (committed and contiguous from the start of the answer),
        so it is safe to stream. Stop ids are excluded.
        """
        end = self.final_len if self.stop_at is None else self.stop_at
        return self.tokens[self.prompt_len : self.prompt_len + end]


class BlockDecoder(ABC):
    """The base of every masked-diffusion decoder: batched proposals and commits at each row's
    masked positions (:meth:`sample`), and the host side of a step that the specialisations
    share (commit a row's tokens, finish, schedule a new block).

    A specialisation implements ``init_state``, ``kv_tokens``, ``prepare`` and ``_commit_row``.
    Decoders hold configuration only; every request's randomness comes from its own generator,
    so a row's result never depends on its batch-mates.
    """

    decoding_mode = "block_diffusion"

    def __init__(self, mask_id: int, stop_ids: Sequence[int]) -> None:
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        # Structured output (set by the registry for the decoders that enforce it): compiles
        # each request's grammar against the model's tokenizer. None: response_format refused.
        self.grammar: TokenGrammar | None = None

    def _new_state(
        self,
        state_type: type[DenoiseState],
        prompt: list[int],
        canvas_length: int,
        params: DecodingParams,
        device: torch.device | str,
        **fields: Any,
    ) -> Any:
        """A state of ``state_type`` whose canvas is ``prompt`` then masks up to
        ``canvas_length``, with the request's stop ids, generator and (structured output)
        grammar matcher."""
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        return state_type(
            tokens=prompt + [self.mask_id] * (canvas_length - len(prompt)),
            prompt_len=len(prompt),
            params=params,
            generator=new_generator(params, device),
            mask_id=self.mask_id,
            stop_ids=stop_ids,
            constraint=request_constraint(self.grammar, params.grammar, stop_ids),
            **fields,
        )

    # ---- the batched step ----------------------------------------------------------------------
    def sample(
        self, states: Sequence[DenoiseState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """Proposals and commits for every row: ``[R, M]`` committed tokens (else ``mask_id``).

        ``logits`` ``[R, M, V]``: row ``r``'s first ``len(states[r].masked)`` entries are its
        masked positions in ascending order (padding after); dense logits are consumed
        (overwritten in place), sharded ones are reduced per rank. No value is read back here.
        When a row reports its confidences (``report_confidence``) the result is ``[R, 2M]``:
        column ``M + j`` holds the confidence of masked position ``j`` in millionths
        (:data:`CONFIDENCE_SCALE`); the commit reads only the first ``M``.
        """
        logits = as_step_logits(logits)
        if logits.sharded is not None:
            # Tensor parallelism: constrained rows take their logits whole (the grammar's
            # mask and the lookahead are the dense code below), the others stay sharded.
            gather = [r for r, s in enumerate(states) if s.constraint is not None and s.masked]
            if gather:
                return sample_split(
                    logits,
                    gather,
                    lambda rows, z: BlockDecoder.sample(self, [states[r] for r in rows], z),
                    self.mask_id,
                )
        rows, width = logits.rows, logits.width
        device = logits.device
        counts = [len(s.masked) for s in states]
        topk = [s.schedule[s.step] if s.params.mode == "topk" else -1 for s in states]
        ints = host_to_device(torch.frombuffer(array("q", counts + topk), dtype=torch.long), device)
        count, k = ints[:rows], ints[rows:]
        # Padding entries (rows with fewer masks than the widest) must never commit; when
        # every row is as wide as the batch there is none, and no mask is needed.
        ragged = any(c != width for c in counts)
        valid = torch.arange(width, device=device)[None, :] < count[:, None] if ragged else None

        # Structured output: each constrained row's first masked position (the first position
        # of its answer not yet committed) may only propose what its grammar allows next.
        constrained = [r for r, s in enumerate(states) if s.constraint is not None and counts[r]]
        lookahead: list[int] = []
        if constrained:
            logits = mask_to_grammar(states, logits, constrained)
            # Greedy rows with a second masked position take their proposals from the most
            # probable valid fill of the block window (read before propose, which consumes
            # the logits).
            lookahead = [
                r for r in constrained if counts[r] > 1 and states[r].params.temperature == 0
            ]
            fills = lookahead_fill(states, logits, lookahead, self.mask_id)

        metrics = [_metric(s.params) for s in states]
        # A zero-commit step draws no noise, so the generator stays in step.
        draws = {
            r: (s.params.temperature, s.generator)
            for r, s in enumerate(states)
            if s.params.temperature > 0 and topk[r] != 0
        }
        x0, score = propose(logits, self.mask_id, counts, draws, metrics)
        if lookahead:
            # The fill's tokens replace the proposals at its positions (DINGO: the positions
            # the rule commits take their tokens from the MAP fill); one host→device copy.
            at_rows = [r for r, fill in zip(lookahead, fills, strict=True) for _ in fill]
            at_cols = [j for fill in fills for j in range(len(fill))]
            values = to_device(at_rows + at_cols + [t for fill in fills for t in fill], device,
                               torch.long)  # fmt: skip
            n = len(at_rows)
            x0[values[:n], values[n : 2 * n]] = values[2 * n :].to(x0.dtype)
        if valid is not None:
            score = score.masked_fill(~valid, float("-inf"))

        commit = _commit_by_row_rule(states, score, k, device)
        if constrained:
            # A constrained row always commits its first masked position (a grammar-allowed
            # token), so it advances at least one token per step whatever its rule picked;
            # the host keeps the valid left-to-right run from there (_commit_masked).
            first = torch.zeros_like(commit)
            first[to_device(constrained, device, torch.long), 0] = True
            commit |= first
        if valid is not None:
            commit &= valid
        out = torch.where(commit, x0, self.mask_id)
        if any(s.report_confidence for s in states):
            # Traced rows only: the confidences ride in the step's one copy, in millionths
            # after the M tokens (padding, at -inf, reads 0).
            millionths = (score.clamp(0.0, 1.0) * CONFIDENCE_SCALE).round().long()
            out = torch.cat([out, millionths], dim=1)
        return out

    def _sample_seeded(
        self,
        states: Sequence[DenoiseState],
        logits: torch.Tensor | ShardedLogits | StepLogits,
        seeding: Sequence[bool],
        *,
        sampled: bool,
    ) -> torch.Tensor:
        """:meth:`sample`, with each seeding row's next-block seed in column 0: the argmax of
        its first requested logit (mask id excluded), or with ``sampled`` at T > 0 an exact
        sample of it. Seeds are read before the masked sampler consumes the logits."""
        logits = as_step_logits(logits)
        if not any(seeding):
            return BlockDecoder.sample(self, states, logits)
        if logits.sharded is not None:
            # Tensor parallelism: a constrained row that draws a seed or proposes tokens
            # takes its logits whole (the grammar's mask is the dense code below).
            gather = [
                r
                for r, s in enumerate(states)
                if s.constraint is not None and (seeding[r] or s.masked)
            ]
            if gather:
                return sample_split(
                    logits,
                    gather,
                    lambda rows, z: self._sample_seeded(
                        [states[r] for r in rows], z, [seeding[r] for r in rows], sampled=sampled
                    ),
                    self.mask_id,
                )
        # Structured output: a seed is the answer's next token (every earlier one is committed
        # and consumed by the matcher), so it is drawn under the grammar's mask.
        grammar_seeds = [r for r, s in enumerate(states) if seeding[r] and s.constraint is not None]
        if grammar_seeds:
            logits = restrict_to_bitmasks(
                logits,
                [logits.offsets[r] for r in grammar_seeds],
                [states[r].constraint.allowed_bits() for r in grammar_seeds],  # type: ignore[union-attr]
            )
        seeds = seed_tokens(logits, self.mask_id)
        if sampled:
            hot = [r for r, s in enumerate(states) if seeding[r] and s.params.temperature > 0]
            for r, z in dense_rows(logits, hot).items():
                probs = target_probs(z[:1], states[r].params.temperature, self.mask_id)
                seeds[r] = sample_inverse_cdf(probs, states[r].generator)[0]
        out = BlockDecoder.sample(self, states, logits)
        if all(seeding):
            out[:, 0] = seeds
        else:
            rows = to_device(list(seeding), out.device)
            out[:, 0] = torch.where(rows, seeds.to(out.dtype), out[:, 0])
        return out

    def commit(
        self, states: Sequence[DenoiseState], committed: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        """Apply one step's results (host lists, row ``r`` aligned with what ``prepare`` asked)."""
        return [self._commit_row(s, row) for s, row in zip(states, committed, strict=True)]

    @abstractmethod
    def _commit_row(self, state: Any, row: Sequence[int]) -> StepResult:
        """One row's commit (each specialisation's own rule for what a step's tokens do)."""

    # ---- host helpers of a step ----------------------------------------------------------------
    def _commit_masked(self, state: DenoiseState, row: Sequence[int]) -> int:
        """Write a row's tokens at the masked positions it committed (``mask_id`` where it
        committed nothing; padding after them is always ``mask_id``), keep the others masked
        and count the step. Returns how many positions were committed."""
        mask_id, tokens, masked = self.mask_id, state.tokens, state.masked
        row = row[: len(masked)]
        if state.constraint is not None and masked:
            row = grammar_run(state, row, mask_id)
        # ``compress`` walks the row in C; the Python loop only runs over this step's commits.
        still = list(compress(masked, map(mask_id.__eq__, row)))
        for pos, token in compress(zip(masked, row, strict=True), map(mask_id.__ne__, row)):
            tokens[pos] = token
        committed = len(masked) - len(still)
        state.masked = still
        state.committed += committed
        state.step += 1
        if state.constraint is not None and still and state.params.mode == "topk":
            # A constrained step commits its valid run, not the schedule's count: spread the
            # masks left over the block's remaining steps (at least one per step).
            steps_left = max(1, len(state.schedule) - state.step)
            state.schedule = block_schedule(
                state.params.block_schedule, len(still), min(steps_left, len(still))
            )
            state.step = 0
        return committed

    @staticmethod
    def _accept_seed(state: DenoiseState, token: int) -> None:
        """A constrained row's seed (drawn under its grammar mask) goes to its matcher."""
        if state.constraint is not None and state.constraint.accept([token]) != 1:
            raise RuntimeError("structured output: the grammar rejected the masked seed")

    @staticmethod
    def _finish_or_continue(state: DenoiseState, committed: int) -> StepResult:
        """Extend the final answer after a step's commits; the request finishes once it holds
        a stop id or reaches its answer budget (``max_tokens``)."""
        new = state.advance_final()
        if state.stop_at is not None or state.final_len == state.params.answer_budget:
            return _finish(state, committed, "stop" if state.stop_at is not None else "length", new)
        return StepResult(committed, False, new_tokens=new)

    @staticmethod
    def _schedule(state: DenoiseState, steps: int) -> None:
        """The schedule of the masks in ``state.masked``: top-k spreads them over
        ``min(steps, masks)`` steps (at least one; no step that commits nothing), the
        data-dependent rules have none (``[0]``)."""
        if state.params.mode != "topk":
            state.schedule = [0]
            return
        steps = max(1, min(steps, len(state.masked)))
        state.schedule = block_schedule(state.params.block_schedule, len(state.masked), steps)


ENTROPY_RULES = ("entropy_bound", "entropy_threshold")


def _metric(params: DecodingParams) -> str:
    """The confidence a row is scored by: the entropy rules read entropies (from
    ``entropy_inverse`` = exp(−H)), every other rule the request's metric."""
    return "entropy_inverse" if params.mode in ENTROPY_RULES else params.confidence_metric


def _finish(state: DenoiseState, committed: int, reason: str, new: int) -> StepResult:
    state.finished = True
    state.finish_reason = reason
    return StepResult(committed=committed, finished=True, finish_reason=reason, new_tokens=new)


def _commit_by_row_rule(
    states: Sequence[DenoiseState], score: torch.Tensor, k: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Which proposals each row commits, under each row's own rule (``[R, M]`` bool).

    A batch may mix requests of every rule. Each rule runs once over the whole batch (only when
    some row uses it) and ``torch.where`` picks every row's own result, so a row commits exactly
    what it would commit alone; the per-row parameters travel in one host→device copy.
    ``score`` ``[R, M]``: confidences of each row's masked positions of its active block
    (``-inf`` on padding); ``k`` ``[R]``: each top-k row's count for this step.
    """
    modes = [s.params.mode for s in states]
    commit = None
    if "topk" in modes:
        # One commit per row (steps == block length, the usual setting): each row's first
        # most confident position is what the stable sort ranks first, at a third of the cost.
        one_each = all(s.schedule[s.step] == 1 for s in states if s.params.mode == "topk")
        commit = argmax_onehot(score) if one_each else topk_commit_rows(score, k)
    if modes.count("topk") == len(modes):
        assert commit is not None
        return commit
    params = [s.params for s in states]
    floats = to_device(
        [_first_threshold(p) for p in params] + [p.local_leap_neighbor_threshold for p in params],
        device,
        score.dtype,
    )
    kappa, tau = floats[: len(params)], floats[len(params) :]
    rule = threshold_commit_rows(score, kappa) if "threshold" in modes else None
    for name, entropy_rule in (
        ("entropy_bound", entropy_bound_commit_rows),
        ("entropy_threshold", entropy_threshold_commit_rows),
    ):
        if name in modes:
            # kappa holds each such row's γ or threshold (nats), see _first_threshold.
            chosen = entropy_rule(entropy_of_score(score), kappa)
            is_rule = to_device([m == name for m in modes], device)
            rule = chosen if rule is None else torch.where(is_rule[:, None], chosen, rule)
    if "local_leap" in modes:
        # The widest active block: a block model's block is its trained one, whatever its
        # params' canvas, so a max_tokens below the block still keeps offsets inside the span.
        span = max(hi - lo for lo, hi in (s.active_block for s in states))
        offsets, radius = _offsets(states, score.shape[1], device)
        leap = local_leap_commit_rows(score, offsets, kappa, tau, radius, span)
        is_leap = to_device([m == "local_leap" for m in modes], device)
        rule = leap if rule is None else torch.where(is_leap[:, None], leap, rule)
    assert rule is not None
    if commit is None:
        return rule
    is_topk = to_device([m == "topk" for m in modes], device)
    return torch.where(is_topk[:, None], commit, rule)


def _first_threshold(params: DecodingParams) -> float:
    """A row's first rule parameter: its confidence threshold (κ for LocalLeap), or its
    entropy bound / entropy threshold in the entropy rules."""
    mode = params.mode
    if mode == "entropy_bound":
        return float(params.entropy_bound)  # type: ignore[arg-type]
    if mode == "entropy_threshold":
        return float(params.entropy_threshold)  # type: ignore[arg-type]
    return params.confidence_threshold or params.local_leap_anchor_threshold


def _offsets(
    states: Sequence[DenoiseState], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block offsets ``[R, M]`` of each row's masked positions (padding repeats the last)
    and each row's LocalLeap radius ``[R]``."""
    flat: list[int] = []
    for s in states:
        lo, _ = s.active_block
        offs = [p - lo for p in s.masked] or [0]
        flat.extend(offs + [offs[-1]] * (width - len(offs)))
    flat.extend(s.params.local_leap_radius for s in states)
    packed = to_device(flat, device, torch.long)
    rows = len(states)
    return packed[: rows * width].view(rows, width), packed[rows * width :]
