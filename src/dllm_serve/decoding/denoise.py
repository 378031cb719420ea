"""LLaDA-style block denoising, batched: every running request advances in one tensor pass."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import compress

import torch

from dllm_serve.decoding.commit_rows import commit_by_row_rule
from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec, StepResult
from dllm_serve.decoding.host_values import host_to_device
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.prefix_cache import after_step, prefix_spec, reset_for_block
from dllm_serve.decoding.proposals import propose
from dllm_serve.decoding.sampling import new_generator
from dllm_serve.decoding.schedules import block_schedule
from dllm_serve.decoding.sharded_vocab import ShardedLogits
from dllm_serve.decoding.state import DenoiseState
from dllm_serve.decoding.stops import request_stop_ids

__all__ = ["DenoiseState", "LLaDADenoiser"]


class LLaDADenoiser:
    """Semi-autoregressive masked-diffusion sampling (LLaDA), with three commit rules.

    The answer region of ``G`` masks is split into ``G / block_length`` blocks decoded left to
    right. At every step the model sees the whole canvas; for each still-masked position of
    the active block we propose ``x0`` (argmax at T = 0, else a Gumbel-max sample from
    ``softmax(z / T)``) and score it with the request's confidence metric. Which proposals are
    committed depends on ``params.mode``:

    - ``topk``: the block gets ``steps_per_block`` steps and a schedule ``k_0..k_{s-1}``
      summing to its mask count; step ``i`` commits the ``k_i`` most confident proposals and
      the rest stay masked ("low-confidence remasking"). With the uniform schedule and
      ``top1_prob`` this is exactly LLaDA's reference ``generate()``, restricted to the
      positions it could commit (it sets every other confidence to ``-inf``).
    - ``threshold`` (Fast-dLLM) and ``local_leap``: see ``decoding/commit.py`` and
      ``decoding/local_leap.py``; each step commits at least one token, so a block takes
      between 1 and ``block_length`` forwards.

    Family rules: with ``logit_shift`` (Dream, I-DLM) the logits that predict position ``j``
    come from position ``j − 1``; with ``bidirectional=False`` the forward is causal.

    Mask lookahead (``mask_lookahead``, None by default = the reference): a forward includes
    the prompt, the committed blocks, the active block and at most that many masks after it.
    Positions after the active block are all masks, so this only drops MASK keys; a model
    trained on canvases of one block (the demos) then reads a 1024-token canvas block by
    block exactly as it reads a one-block canvas, and a forward costs a block, not a canvas.

    Prefix KV cache (``prefix_cache``; ``decoding/prefix_cache.py``): the first step of each
    block is the full forward and keeps the committed prefix's keys and values; the block's
    other steps forward only the canvas from the block on. Commit rules, schedules and the
    early stop are unchanged: only the logits differ (Fast-dLLM's approximation).

    One step for a batch of requests: :meth:`prepare` (host only: each row's tokens and the
    positions whose logits it needs — the masked positions of its active block, which the
    host copy of the canvas knows) → the forward → :meth:`sample` (tensor in, tensor out: the
    proposals and commits of every row at once, ``[R, M]`` tokens, ``mask_id`` where nothing
    was committed) → one device→host copy by the caller → :meth:`commit` (host: write the
    tokens, advance blocks, detect the end). The denoiser holds only configuration; every
    request's randomness comes from its own generator, so a row's result never depends on its
    batch-mates.
    """

    decoding_mode = "diffusion"

    def __init__(
        self,
        mask_id: int,
        stop_ids: Sequence[int],
        *,
        logit_shift: bool = False,
        bidirectional: bool = True,
        prefix_cache: bool = False,
        mask_lookahead: int | None = None,
    ) -> None:
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.logit_shift = logit_shift
        self.attention = AttentionKind.BIDIRECTIONAL if bidirectional else AttentionKind.CAUSAL
        self.prefix_cache = prefix_cache
        if mask_lookahead is not None and mask_lookahead < 0:
            raise ValueError("mask_lookahead must be >= 0 (None: the whole canvas)")
        self.mask_lookahead = mask_lookahead
        self._shift = 1 if logit_shift else 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DenoiseState:
        """The canvas ``[prompt ; mask × gen_length]`` and the request's generator."""
        prompt = [int(t) for t in prompt_ids]
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        if self.logit_shift and not prompt:
            # The first answer position is predicted from the last prompt position.
            raise ValueError("a model with shifted logits needs a non-empty prompt")
        state = DenoiseState(
            tokens=prompt + [self.mask_id] * params.gen_length,
            prompt_len=len(prompt),
            params=params,
            generator=new_generator(params, device),
            mask_id=self.mask_id,
            stop_ids=stop_ids,
            mask_lookahead=self.mask_lookahead,
        )
        self._start_block(state)
        return state

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """KV-pool slots a request needs: its whole canvas with the prefix cache, else none."""
        return prompt_len + params.gen_length if self.prefix_cache else 0

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, state: DenoiseState) -> RowSpec:
        """The row: the whole canvas (or, with a prefix cache, the part after the prefix);
        logits for the active block's masked positions."""
        if state.finished:
            raise RuntimeError("prepare() called on a finished request")
        if state.kv is not None:
            return prefix_spec(state, self._shift, self.attention)
        window = state.mask_lookahead is not None
        return RowSpec(
            tokens=state.tokens[: state.visible_end] if window else state.tokens,
            start=0,
            # Shifted families predict position j at j − 1; j − 1 ≥ prompt_len − 1 ≥ 0.
            logits_at=[p - self._shift for p in state.masked],
            attention=self.attention,
        )

    def sample(
        self, states: Sequence[DenoiseState], logits: torch.Tensor | ShardedLogits
    ) -> torch.Tensor:
        """Proposals and commits for every row: ``[R, M]`` committed tokens (else ``mask_id``).

        ``logits`` ``[R, M, V]``: row ``r``'s first ``len(states[r].masked)`` entries are its
        masked positions in ascending order (padding after); dense logits are consumed
        (overwritten in place), sharded ones are reduced per rank. No value is read back here.
        """
        rows, width = logits.shape[0], logits.shape[1]
        device = logits.device
        counts = [len(s.masked) for s in states]
        topk = [s.schedule[s.step] if s.params.mode == "topk" else -1 for s in states]
        ints = host_to_device(torch.frombuffer(array("q", counts + topk), dtype=torch.long), device)
        count, k = ints[:rows], ints[rows:]
        # Padding entries (rows with fewer masks than the widest) must never commit; when
        # every row is as wide as the batch there is none, and no mask is needed.
        ragged = any(c != width for c in counts)
        valid = torch.arange(width, device=device)[None, :] < count[:, None] if ragged else None

        metrics = [s.params.confidence_metric for s in states]
        # A zero-commit step draws no noise, so the generator stays in step.
        draws = {
            r: (s.params.temperature, s.generator)
            for r, s in enumerate(states)
            if s.params.temperature > 0 and topk[r] != 0
        }
        x0, score = propose(logits, self.mask_id, counts, draws, metrics)
        if valid is not None:
            score = score.masked_fill(~valid, float("-inf"))

        commit = commit_by_row_rule(states, score, k, device)
        if valid is not None:
            commit &= valid
        return torch.where(commit, x0, self.mask_id)

    def commit(
        self, states: Sequence[DenoiseState], committed: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        """Apply one step's commits (host lists, row ``r`` aligned with ``states[r].masked``)."""
        return [self._commit_row(s, row) for s, row in zip(states, committed, strict=True)]

    def _commit_row(self, state: DenoiseState, row: Sequence[int]) -> StepResult:
        if state.finished:
            raise RuntimeError("commit() called on a finished request")
        mask_id, tokens, masked = self.mask_id, state.tokens, state.masked
        row = row[: len(masked)]  # the padding entries after them are always mask_id
        # ``compress`` walks the row in C; the Python loop only runs over this step's commits.
        still = list(compress(masked, map(mask_id.__eq__, row)))
        for pos, token in compress(zip(masked, row, strict=True), map(mask_id.__ne__, row)):
            tokens[pos] = token
        committed = len(masked) - len(still)
        params = state.params
        if params.mode == "topk":
            # The schedule sums to the block's mask count and each step commits exactly its
            # entry, so the masks left always cover it.
            assert committed == state.schedule[state.step], "schedule out of sync with the canvas"
        state.masked = still
        state.committed += committed
        state.nfe += 1
        state.step += 1
        after_step(state, self._shift)
        new = state.advance_final()
        if state.stop_at is not None:
            # Exact early stop: the answer is the canvas cut before its first stop id. Every
            # position up to and including that stop id is committed, and committed tokens
            # never change, so no later step can alter the answer; decoding the rest of the
            # canvas would only fill positions that are discarded anyway.
            return self._finish(state, committed, "stop", new)
        if state.final_len == params.answer_budget:
            # The whole answer is committed and no stop id appeared. Trailing zero-commit
            # steps of the last block (steps_per_block > block_length) would change nothing,
            # and neither would the canvas positions past an answer limit: skip them.
            return self._finish(state, committed, "length", new)
        # A block is done when it has no mask left. In top-k mode that can come before its
        # schedule ends: with more steps per block than positions, the uniform schedule's
        # zero-commit steps come last, and they would change nothing (no noise is drawn for
        # them either), so the next block starts at once, as in the last block above.
        if not still:
            state.block += 1
            state.step = 0
            self._start_block(state)
        return StepResult(committed=committed, finished=False, new_tokens=new)

    # ---- one request at a time (tests, simple drivers) -------------------------------------------
    def update(self, state: DenoiseState, logits: torch.Tensor) -> StepResult:
        """:meth:`sample` + :meth:`commit` for one row, ``logits`` ``[len(masked), V]``."""
        if state.finished:
            raise RuntimeError("update() called on a finished request")
        if logits.dim() != 2 or logits.shape[0] != len(state.masked):
            raise ValueError(
                f"expected logits [{len(state.masked)}, V] for the positions prepare() returned, "
                f"got {tuple(logits.shape)}"
            )
        committed = self.sample([state], logits[None].clone()).tolist()
        return self.commit([state], committed)[0]

    # ---- helpers -------------------------------------------------------------------------------
    def _start_block(self, state: DenoiseState) -> None:
        """Empty the prefix cache (the block's first forward refreshes it), list the block's
        masks and compute its schedule (top-k mode only). Blocks are committed left to right
        and only the active block receives commits, so a new block is all masks."""
        reset_for_block(state)
        lo, hi = state.active_block
        state.masked = list(range(lo, hi))
        if state.params.mode != "topk":
            state.schedule = []
            return
        state.schedule = block_schedule(
            state.params.block_schedule, len(state.masked), state.params.steps_per_block
        )

    @staticmethod
    def _finish(state: DenoiseState, committed: int, reason: str, new: int) -> StepResult:
        state.finished = True
        state.finish_reason = reason
        return StepResult(committed=committed, finished=True, finish_reason=reason, new_tokens=new)
