"""**Block diffusion (SDAR/TraDo, LLaDA2.x, LLaDA-MoE blocks): :class:`BlockDiffusionDecoder`.**
The model was trained block-causal — bidirectional inside blocks of ``B`` tokens aligned to
position 0, causal across blocks — so once a block is final its keys and values never change,
and a decode step forwards only the active block against the cached prefix. Per request:

1. **Prefill** (when the prompt holds whole blocks): one forward over those ``⌊P/B⌋·B`` tokens
   with the block-causal mask, keeping their K/V.
2. **Decode** the active block (the prompt's tail shares the first one, as in training): each
   step forwards the block's ``B`` tokens at their positions against the cached prefix (no
   mask: the block sees the prefix and itself) and commits proposals at its masked positions
   by the request's rule, top-k over ``min(steps, masks)`` steps.
3. **Write**: once the block has no mask, its final K/V must be computed from its clean tokens.
   Every engine that serves these models spends one more forward of the clean block on it
   (SGLang, dInfer, LMDeploy, mlx-lm); here (``fuse_write``, the default) it is fused with the
   next block's first step: one block-causal forward over both blocks, in which the finished
   block's queries see the prefix and themselves — the same K/V a separate forward computes —
   and the next block's see the prefix and both. That saves one forward per block (tested:
   the same tokens as the unfused loop and as the no-cache reference).

The shared state and batched step are ``blocks.py``'s; the answer rules are as there.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.blocks import (
    CONFIDENCE_SCALE,
    DECODE,
    PREFILL,
    WRITE,
    BlockDecoder,
    DenoiseState,
)
from dllm_serve.decoding.commit_rules import (
    InDelCounters,
    InDelStep,
    indel_rebuild,
    indel_step,
    joint_threshold_commit_rows,
)
from dllm_serve.decoding.params import DecodingParams
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
    propose,
    select_rows,
)
from dllm_serve.models.attention import host_to_device, to_device


@dataclass(slots=True, eq=False)
class BlockState(DenoiseState):
    """One block-diffusion request: a denoising state whose blocks are aligned to position 0.

    ``tokens`` is ``prompt + mask × (whole blocks up to max_tokens)`` (the answer budget is
    ``params.gen_length``; positions past it are decoded and dropped); ``block`` indexes the
    active block counted from position 0 and ``block_size`` is the checkpoint's; ``phase`` is
    what the next forward does (prefill the prompt's whole blocks, decode the active block, or
    — unfused — write the finished block's K/V). ``write_pending``: the previous block is final
    and its K/V come with the next forward (fused write).
    """

    block_size: int = 0
    phase: str = DECODE
    write_pending: bool = False
    # Token editing (params.mode == "joint_threshold"): the active block's positions past the
    # prompt (every one may be rewritten until the block closes), the block's mask-free steps
    # so far, and the edits made (token → another token) over the whole request.
    editable: list[int] = field(default_factory=list)
    post_edit_steps: int = 0
    edits: int = 0
    # Insert/delete editing (LLaDA2.2, JointThresholdInDel; an editing request on a decoder
    # with edit tokens): per editable position whether it holds (or carried) one of the
    # block's original masks, the block's step counters, the block states already forwarded
    # and the tokens written at each position (the anti-loop rule), and the step the sampler
    # decided for the next commit.
    indel: bool = False
    original: list[bool] = field(default_factory=list)
    indel_counters: InDelCounters = field(default_factory=InDelCounters)
    seen: set[tuple[int, ...]] = field(default_factory=set)
    history: list[set[int]] = field(default_factory=list)
    pending: InDelStep | None = None

    @property
    def editing(self) -> bool:
        return self.params.mode == "joint_threshold"

    @property
    def active_block(self) -> tuple[int, int]:
        lo = self.block * self.block_size
        return lo, lo + self.block_size

    @property
    def is_prefill(self) -> bool:
        return self.phase == PREFILL

    @property
    def row_length(self) -> int:
        if self.phase == PREFILL:  # the prompt's whole blocks past a prefix-cache hit
            return self.active_block[0] - (self.kv.length if self.kv is not None else 0)
        return 2 * self.block_size if self.write_pending else self.block_size


def _kind(state: DenoiseState) -> str:
    """Which sampler a row takes: insert/delete editing, token editing or the plain rules."""
    if isinstance(state, BlockState) and state.indel:
        return "indel"
    return "edit" if isinstance(state, BlockState) and state.editing else "plain"


class BlockDiffusionDecoder(BlockDecoder):
    """Block-diffusion decoding over an exact KV cache (SDAR, LLaDA2.x; see the module
    docstring).

    ``block_size`` is the checkpoint's trained block; requests cannot change it (the API
    rejects another ``block_length``).

    **Token editing** (``editing``: LLaDA2.1 checkpoints; a request with ``edit_threshold``).
    JointThreshold asks for logits at every position of the active block past the prompt and
    writes masks above τ_mask (or the most confident one) and edits of committed tokens above
    τ_edit (``commit_rules.joint_threshold_commit_rows``). A step without masks counts one
    post-edit step; the block closes, changing nothing, on a step that writes nothing or once
    the post-edit steps exceed ``max_post_edit_steps``. Either way the forward that produced
    that step saw the block's final tokens and wrote their K/V, so the block's cache is exact
    with no write forward, and a block takes at most ``masks + max_post_edit_steps + 1``
    forwards. Tokens of the open block may still change, so the answer (streamed, and
    searched for stop ids) grows only when a block closes. The mask id is never proposed
    (as in every other rule here; SGLang's argmax may propose it and write it back).

    **Insert/delete editing** (``edit_tokens`` = LLaDA2.2's ``(DELETE, SPLIT)`` ids; the same
    request fields): JointThresholdInDel (``commit_rules.indel_step``). A written DELETE
    removes its position and SPLIT opens a mask before the token that was there; the block's
    editable part is rebuilt left to right at its fixed length (``commit_rules.indel_rebuild``;
    the prompt's tail in the block is never touched). Masks the block started with are told
    apart from masks edits introduced; a cleanup round (post-edit budget spent, or a hard cap of
    ``block + max_post_edit_steps`` update steps) writes every mask and forbids MASK, DELETE and
    SPLIT; revisiting a block state redraws one position away from what it held before. The
    block closes on a step that writes nothing, or after the cleanup round: when that round
    changed a token, one more forward of the block persists its final K/V (``WRITE``), so a
    block takes at most ``block + max_post_edit_steps + 2`` forwards and its cache is always a
    forward of its final tokens. The sampler decides these rows one at a time on the host
    (the rule is sequential: the anti-loop redraw depends on the rest of the step) and
    greedily: requests with ``temperature > 0`` or ``logprobs`` are refused (positions move
    under DELETE and SPLIT, so a position's logprob would not follow its token).
    """

    def __init__(
        self,
        mask_id: int,
        stop_ids: Sequence[int],
        block_size: int,
        *,
        fuse_write: bool = True,
        editing: bool = False,
        edit_tokens: tuple[int, int] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        if edit_tokens is not None:
            delete, split = edit_tokens
            if not editing or len({delete, split, mask_id}) != 3:
                raise ValueError(
                    "insert/delete editing needs an editing decoder and DELETE, SPLIT and the "
                    f"mask as three distinct ids, got {edit_tokens} with mask {mask_id}"
                )
        super().__init__(mask_id, stop_ids)
        self.fuse_write = fuse_write
        self.block_size = block_size
        self.editing = editing
        # LLaDA2.2's (DELETE, SPLIT) ids: editing requests decode by JointThresholdInDel.
        self.edit_tokens = edit_tokens

    def _canvas_length(self, prompt_len: int, params: DecodingParams) -> int:
        """Prompt + answer budget, rounded up to whole blocks from position 0."""
        b = self.block_size
        return -(-(prompt_len + params.gen_length) // b) * b

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        return self._canvas_length(prompt_len, params)

    # Prefix reuse (protocol.PrefixReuse): a final block's K/V depend on the blocks up to it
    # only, so a hit is whole blocks.
    @property
    def prefix_alignment(self) -> int:
        return self.block_size

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """The prompt's whole blocks (the prefill computes nothing the decode reads but K/V)."""
        return prompt_len // self.block_size * self.block_size

    def reuse_prefix(self, state: BlockState, tokens: int) -> None:
        """The prefill forwards the whole blocks past the cached ``tokens``; none left: the
        request starts with its first decode step."""
        assert state.kv is not None and state.kv.length == tokens and state.phase == PREFILL
        if tokens == state.active_block[0]:
            self._start_block(state)

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> BlockState:
        prompt = [int(t) for t in prompt_ids]
        first_block = len(prompt) // self.block_size
        state: BlockState = self._new_state(
            BlockState, prompt, self._canvas_length(len(prompt), params), params, device,
            block_size=self.block_size, block=first_block,
            phase=PREFILL if first_block else DECODE,
        )  # fmt: skip
        state.indel = state.editing and self.edit_tokens is not None
        if state.phase == DECODE:
            self._start_block(state)
        else:
            state.schedule = [0]  # a prefill commits nothing (the sampler reads k = 0)
        return state

    def prepare(self, state: BlockState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        lo, hi = state.active_block
        if state.phase == PREFILL:  # the prompt's whole blocks, block-causal, K/V kept
            done = state.kv.length  # a prefix-cache hit: whole blocks, cached already
            return RowSpec(
                tokens=state.tokens[done:lo], start=done, logits_at=[lo - 1 - done],
                attention=AttentionKind.BLOCK_CAUSAL, kv=state.kv, block=self.block_size,
            )  # fmt: skip
        start = lo - self.block_size if state.write_pending else lo
        if state.kv.length != start:
            raise RuntimeError(f"block cache holds {state.kv.length} positions, expected {start}")
        offsets = [p - start for p in state.masked] if state.phase == DECODE else [0]
        if state.write_pending:
            # The finished block and the active one in one forward, block-causal: the finished
            # block's queries see the prefix and itself (its final K/V, as a separate write
            # forward computes them), the active block's see the prefix and both blocks.
            return RowSpec(
                tokens=state.tokens[start:hi], start=start, logits_at=offsets,
                attention=AttentionKind.BLOCK_CAUSAL, kv=state.kv, block=self.block_size,
            )  # fmt: skip
        if state.editing:
            offsets = [p - lo for p in state.editable]
        return RowSpec(tokens=state.tokens[lo:hi], start=lo, logits_at=offsets, kv=state.kv)

    def sample(
        self, states: Sequence[DenoiseState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """:meth:`BlockDecoder.sample`, with editing rows (JointThreshold) and insert/delete
        rows (JointThresholdInDel) by their own rules; a mixed batch runs each part on its own
        rows and returns them side by side, ``[R, W]`` (narrower parts padded with
        ``mask_id``, which no commit reads)."""
        kinds = [_kind(s) for s in states]
        samplers = {
            "plain": lambda sub, z: BlockDecoder.sample(self, sub, z),
            "edit": self._sample_edits,
            "indel": self._sample_indel,
        }
        if len(set(kinds)) == 1:
            return samplers[kinds[0]](states, logits)  # type: ignore[operator]
        logits = as_step_logits(logits)
        parts = []
        for kind in [k for k in samplers if k in kinds]:  # a fixed order: plain rows first
            rows = [r for r, k in enumerate(kinds) if k == kind]
            sub_states = [states[r] for r in rows]
            sub = samplers[kind](sub_states, select_rows(logits, rows))  # type: ignore[operator]
            parts.append((to_device(rows, logits.device), sub))
        width = max(sub.shape[1] for _, sub in parts)
        out = torch.full((len(states), width), self.mask_id, dtype=torch.long, device=logits.device)
        for index, sub in parts:
            out[index, : sub.shape[1]] = sub.to(torch.long)
        return out

    def _sample_edits(
        self, states: Sequence[BlockState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """JointThreshold for rows whose logits are at their editable positions: ``[R, M]``
        tokens to write (``mask_id``: leave the position as it is), plus the confidences in
        millionths when a row reports them (as :meth:`BlockDecoder.sample`)."""
        logits = as_step_logits(logits)
        rows, width, device = logits.rows, logits.width, logits.device
        counts = [len(s.editable) if s.phase == DECODE else 0 for s in states]
        draws = {
            r: (s.params.temperature, s.generator)
            for r, s in enumerate(states)
            if s.params.temperature > 0 and counts[r]
        }
        metrics = [s.params.confidence_metric for s in states]
        x0, score = propose(logits, self.mask_id, counts, draws, metrics)
        # One host→device copy: counts, then per row its masked flags and current tokens.
        host: list[int] = list(counts)
        for s, n in zip(states, counts, strict=True):
            here = [s.tokens[p] for p in s.editable[:n]] + [self.mask_id] * (width - n)
            host.extend(int(t == self.mask_id) for t in here)
            host.extend(here)
        ints = host_to_device(torch.frombuffer(array("q", host), dtype=torch.long), device)
        count = ints[:rows]
        per_row = ints[rows:].view(rows, 2, width)
        masked, current = per_row[:, 0].bool(), per_row[:, 1]
        taus = to_device(
            [s.params.mask_threshold for s in states]
            + [float(s.params.edit_threshold or 0.0) for s in states],
            device,
            score.dtype,
        )
        valid = torch.arange(width, device=device)[None, :] < count[:, None]
        commit = joint_threshold_commit_rows(
            score, x0, current, masked, valid, taus[:rows], taus[rows:]
        )
        out = torch.where(commit, x0, self.mask_id)
        if any(s.report_confidence for s in states):
            millionths = (score.clamp(0.0, 1.0) * CONFIDENCE_SCALE).round().long()
            out = torch.cat([out, millionths.masked_fill(~valid, 0)], dim=1)
        return out

    def _sample_indel(
        self, states: Sequence[BlockState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """JointThresholdInDel for rows whose logits are at their editable positions: ``[R,
        M]`` tokens to write (``mask_id``: leave the position as it is; the rule never writes
        a mask), plus the confidences in millionths when a row reports them. Each row's step
        (``commit_rules.indel_step``) is decided here, where the logits are, and kept on its
        state for the commit."""
        assert self.edit_tokens is not None
        logits = as_step_logits(logits)
        rows, width = logits.rows, logits.width
        mask_id, (delete, split) = self.mask_id, self.edit_tokens
        out = [[mask_id] * width for _ in range(rows)]
        scores = [[0] * width for _ in range(rows)]
        active = [r for r, s in enumerate(states) if s.phase == DECODE and s.editable]
        for r, z_row in dense_rows(logits, active).items():
            state = states[r]
            n = len(state.editable)
            # A copy: the logits are shared with the other rows' samplers and logprobs.
            z = z_row[:n].float().clone()
            z[:, mask_id] = float("-inf")  # as propose(): the mask is never proposed
            probs = torch.softmax(z, dim=-1)
            proposals = z.argmax(-1)
            clean_z = z.clone()
            clean_z[:, [delete, split]] = float("-inf")
            # One read back per row: proposals, their probabilities, the clean argmax.
            x, p, clean = torch.stack(
                [proposals.double(), probs.gather(-1, proposals[:, None])[:, 0].double(),
                 clean_z.argmax(-1).double()]
            ).tolist()  # fmt: skip

            def redraw(i: int, excluded: set[int], z: torch.Tensor = z) -> int:
                """The argmax at editable position ``i`` without the ``excluded`` tokens."""
                row = z[i].clone()
                row[sorted(excluded)] = float("-inf")
                return int(row.argmax())

            current = state.tokens[state.editable[0] : state.active_block[1]]
            params = state.params
            step = indel_step(
                current, state.original, [int(t) for t in x], p, [int(t) for t in clean],
                state.indel_counters, mask_id=mask_id, block_size=self.block_size,
                mask_threshold=params.mask_threshold,
                edit_threshold=float(params.edit_threshold or 0.0),
                max_post_edit_steps=params.max_post_edit_steps,
                seen_before=tuple(current) in state.seen, history=state.history,
                redraw=redraw,
            )  # fmt: skip
            state.pending = step
            out[r][:n] = [mask_id if w is None else w for w in step.writes]
            scores[r][:n] = [round(min(max(q, 0.0), 1.0) * CONFIDENCE_SCALE) for q in p]
        if any(s.report_confidence for s in states):
            out = [a + b for a, b in zip(out, scores, strict=True)]
        return torch.tensor(out, dtype=torch.long, device=logits.device)

    def _commit_row(self, state: BlockState, row: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        state.nfe += 1
        lo, hi = state.active_block
        if state.phase == PREFILL:
            state.kv.length = lo
            state.phase = DECODE
            self._start_block(state)
            return StepResult(committed=0, finished=False)
        if state.phase == WRITE and state.indel:  # the cleanup round's tokens are cached now
            return self._close_edited_block(state)
        if state.phase == WRITE:  # the block's final K/V are in place: keep them, move on
            state.kv.length = hi
            state.block += 1
            self._start_block(state)
            return StepResult(committed=0, finished=False)
        if state.indel:
            return self._commit_indel(state, row)
        if state.editing:
            return self._commit_edits(state, row)
        if state.write_pending:  # the previous block's final K/V came with this forward
            state.kv.length = lo
            state.write_pending = False
        result = self._finish_or_continue(state, self._commit_masked(state, row))
        if result.finished:
            return result
        if not state.masked and self.fuse_write:
            # The next block's first step will also write this block's final K/V.
            state.block += 1
            self._start_block(state)
            state.write_pending = True
        elif not state.masked:
            state.phase = WRITE
            state.schedule, state.step = [0], 0  # the write forward commits nothing
        return result

    def _commit_edits(self, state: BlockState, row: Sequence[int]) -> StepResult:
        """One JointThreshold step of an editing row (see the class docstring)."""
        mask_id, tokens = self.mask_id, state.tokens
        if not state.masked:
            state.post_edit_steps += 1
            if state.post_edit_steps > state.params.max_post_edit_steps:
                return self._close_edited_block(state)  # budget spent: this step writes nothing
        writes = [(p, t) for p, t in zip(state.editable, row, strict=False) if t != mask_id]
        if not writes:
            return self._close_edited_block(state)
        committed = 0
        for pos, token in writes:
            if tokens[pos] == mask_id:
                committed += 1
            else:
                state.edits += 1
            tokens[pos] = token
        state.masked = [p for p in state.masked if tokens[p] == mask_id]
        state.committed += committed
        state.step += 1
        return StepResult(committed, False)

    def _commit_indel(self, state: BlockState, row: Sequence[int]) -> StepResult:
        """One JointThresholdInDel step of an insert/delete row: the writes the sampler
        decided, then the fixed-length rebuild (see the class docstring)."""
        assert self.edit_tokens is not None
        step, state.pending = state.pending, None
        if step is None:
            raise RuntimeError("an insert/delete row was committed without its sampled step")
        mask_id, tokens = self.mask_id, state.tokens
        lo, hi = state.active_block
        first = state.editable[0]
        before = tokens[first:hi]
        writes: list[int | None] = [None if t == mask_id else t for t in row[: len(before)]]
        state.indel_counters = step.counters
        state.seen.add(tuple(before))
        state.step += 1
        if all(w is None for w in writes):
            return self._close_edited_block(state)  # this forward saw the final tokens
        for seen, token in zip(state.history, writes, strict=True):
            if token is not None:
                seen.add(token)
        delete, split = self.edit_tokens
        after, state.original = indel_rebuild(
            before, state.original, writes, mask_id=mask_id, delete_id=delete, split_id=split
        )
        tokens[first:hi] = after
        state.edits += sum(
            w is not None and b != mask_id and w != b for b, w in zip(before, writes, strict=True)
        )
        committed = max(0, before.count(mask_id) - after.count(mask_id))
        state.committed += committed
        state.masked = [p for p in range(lo, hi) if tokens[p] == mask_id]
        if step.final:
            if after == before:  # this forward saw the final tokens: their K/V are cached
                return self._close_edited_block(state)
            # One more forward of the block writes the K/V of its final tokens (commits nothing).
            state.phase = WRITE
        return StepResult(committed, False)

    def _close_edited_block(self, state: BlockState) -> StepResult:
        """The open block is final: the forward just run saw its final tokens and wrote
        their K/V, so keep them and move on (or finish)."""
        assert state.kv is not None
        state.kv.length = state.active_block[1]
        result = self._finish_or_continue(state, 0)
        if not result.finished:
            state.block += 1
            self._start_block(state)
        return result

    def _start_block(self, state: BlockState) -> None:
        """The active block's masks and, for top-k, its schedule over ``min(steps, masks)``
        steps (no step that commits nothing); an editing row's editable positions."""
        lo, hi = state.active_block
        state.phase = DECODE
        state.step = 0
        state.masked = [p for p in range(lo, hi) if state.tokens[p] == self.mask_id]
        if state.editing:
            state.editable = list(range(max(lo, state.prompt_len), hi))
            state.post_edit_steps = 0
        if state.indel:
            state.original = [state.tokens[p] == self.mask_id for p in state.editable]
            state.indel_counters = InDelCounters()
            state.seen = set()
            state.history = [set() for _ in state.editable]
            state.pending = None
        self._schedule(state, state.params.steps)
