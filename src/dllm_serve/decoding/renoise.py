"""DiffusionGemma's entropy-bounded renoise sampler (transformers' ``EntropyBoundSampler``,
SGLang's ``Gemma4Renoise``), batched over the rows of a step.

A uniform-state diffusion model has no mask token: the answer is produced canvas by canvas
(``canvas_length`` tokens, 256 in the released checkpoint), and each canvas is denoised from
uniformly random token ids. For a canvas, with ``N`` steps (the request's
``num_denoising_steps``, default the checkpoint's ``max_denoising_steps``), bound ``β``,
confidence ``c`` and stability ``S`` (generation_config.json):

.. code-block:: text

    x ← uniform ids                                        (the request's generator)
    for n = N, N−1, …, 1:                                  (n = steps remaining)
        T     = t_min + (t_max − t_min) · n / N            (0.8 → 0.4 + 0.4/N; fp32 as transformers)
        ℓ     = decoder(x, prefix K/V, self-cond) / T
        p     = softmax(ℓ);  H_i = entropy(p_i);  a = argmax ℓ
        d_i   ~ Categorical(p_i)                           (every position; torch.multinomial)
        accept i  iff  Σ_{H_j < H_i in sorted order} H_j ≤ β   (the lowest-entropy one always)
        x_i   ← d_i if accepted else a fresh uniform id    (the "renoise"; nothing is locked)
        stop  iff  a equals the previous S argmax canvases  and  mean_i H_i < c
        self-cond for the next step = softmax(ℓ) @ E · √H
    emit a (the argmax canvas of the last step), cut at the first EOS id
    commit: one causal encoder pass over a writes its K/V; the next canvas starts from noise

The random draws come from the request's own generator in transformers' order (the initial
canvas; then per step the multinomial draw, then the renoise ids — drawn every step, the last
one too), so with the same seed a request gives the answer ``generate`` gives after
``torch.manual_seed(seed)`` on the same device, and never depends on its batch-mates.

**Structured output** (``response_format``; decoding/grammar.py). The denoising is the
model's own; what a constrained request emits is the last step's canvas *projected onto the
grammar*, left to right: each position keeps its argmax where the grammar allows it and the
text cannot end there, and otherwise takes the first token of the best grammar-valid fill of
the next :data:`~dllm_serve.decoding.structured.LOOKAHEAD_DEPTH` positions under that step's
log-probabilities (the lookahead of the masked decoders, so a token that completes the text
competes through the stop id it enables). Every emitted token is consumed by the request's
matcher before it joins the answer and before its canvas is encoded as context, so the answer
is always a prefix of a valid string, ended by a stop id only where it is complete, exactly as
for masked diffusion. The cost: the last step's logits of a constrained row are kept on the
device until its next step, and each lookahead window (only where the argmax is refused or
the text could end) is one device→host copy of ``D × V`` log-probabilities.

Rows: a prefill (the prompt) and a commit (the last canvas) are causal encoder rows whose
logits nobody reads; their sample draws the next canvas. A denoising row is the canvas,
bidirectional over the cached prefix, with the previous step's soft embedding as its
``model_input``. ``sample`` returns ``[R, 2C + 1]``: the next canvas, the argmax canvas and the
stop flag (one device→host copy for the step, made by the engine).
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
from dllm_serve.decoding.sampler import new_generator
from dllm_serve.decoding.structured import LOOKAHEAD_DEPTH, beam_fill
from dllm_serve.models.kv_pool import KVPages

PREFILL, DENOISE, COMMIT = "prefill", "denoise", "commit"  # what the next forward does


@dataclass(frozen=True)
class RenoiseSettings:
    """The sampler's settings from a checkpoint's ``generation_config.json`` (the released
    values are the defaults)."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_max: float = 0.8
    t_min: float = 0.4
    confidence_threshold: float = 0.005  # 0 disables the early stop's confidence test
    stability_threshold: int = 1  # previous argmax canvases that must equal this one

    def __post_init__(self) -> None:
        if self.max_denoising_steps < 1:
            raise ValueError("max_denoising_steps must be >= 1")
        if not self.entropy_bound > 0:
            raise ValueError("entropy_bound must be > 0")
        if not 0 < self.t_min <= self.t_max:
            raise ValueError("the temperature schedule needs 0 < t_min <= t_max")
        if self.stability_threshold < 0 or self.confidence_threshold < 0:
            raise ValueError("stability_threshold and confidence_threshold must be >= 0")


def renoise_settings(generation: dict[str, object]) -> RenoiseSettings:
    """The sampler settings of a ``generation_config.json`` (transformers' defaults, which are
    the released values, for the keys it leaves out or null). A ``sampler_config`` other than
    the entropy-bound one is refused: this module implements that sampler only."""
    defaults = RenoiseSettings()
    sampler = generation.get("sampler_config") or {}
    if not isinstance(sampler, dict):
        raise ValueError("generation_config.json: sampler_config must be an object")
    name = sampler.get("_cls_name", "EntropyBoundSamplerConfig")
    if "EntropyBound" not in str(name):
        raise ValueError(
            f"generation_config.json: sampler_config {name!r}; only the entropy-bound sampler "
            "(EntropyBoundSamplerConfig) is implemented"
        )

    def value(source: dict[str, object], key: str, default: float) -> float:
        got = source.get(key)
        if got is None:
            return default
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise ValueError(f"generation_config.json: {key} must be a number, got {got!r}")
        return got

    steps = value(generation, "max_denoising_steps", defaults.max_denoising_steps)
    stability = value(generation, "stability_threshold", defaults.stability_threshold)
    if steps != int(steps) or stability != int(stability):
        raise ValueError(
            "generation_config.json: max_denoising_steps and stability_threshold are integers"
        )
    return RenoiseSettings(
        max_denoising_steps=int(steps),
        entropy_bound=float(value(sampler, "entropy_bound", defaults.entropy_bound)),
        t_max=float(value(generation, "t_max", defaults.t_max)),
        t_min=float(value(generation, "t_min", defaults.t_min)),
        confidence_threshold=float(
            value(generation, "confidence_threshold", defaults.confidence_threshold)
        ),
        stability_threshold=int(stability),
    )


def schedule_temperature(settings: RenoiseSettings, remaining: int, steps: int) -> float:
    """``t_min + (t_max − t_min) · remaining / steps`` computed in fp32 exactly as transformers'
    ``LinearTemperatureScheduleLogitsProcessor`` does (an int32 step divided by the step
    count), returned as the Python float of that fp32 value: dividing the logits by it gives
    bit for bit transformers' processed logits."""
    n = torch.tensor(remaining, dtype=torch.int32)
    return float(settings.t_min + ((settings.t_max - settings.t_min) * (n / steps)))


def token_entropy(processed: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(processed)`` per row, with ``torch.distributions.Categorical``'s
    ops (normalised logits clamped at the dtype's minimum), without its validation, which
    would read values back to the host."""
    logits = processed - processed.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)
    clamped = logits.clamp(min=torch.finfo(logits.dtype).min)
    return -(clamped * probs).sum(-1)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """EB-sampler acceptance (arXiv:2505.24857): sorted by entropy, position ``k`` is accepted
    iff the sum of the entropies below it is ≤ ``bound`` (``cumsum − own ≤ bound``), so the
    lowest-entropy position always is. Bool mask of ``entropy``'s shape."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    selected = ordered.cumsum(dim=-1) - ordered <= bound
    return torch.zeros_like(selected).scatter(-1, order, selected)


@dataclass(slots=True, eq=False)
class RenoiseState:
    """One request decoded by :class:`RenoiseDecoder`; ``phase`` is what its next forward does.

    Host side: the prompt, the current canvas and the last argmax canvas (lists), the answer
    so far. Device side (carried from one step to the next, never read back): the
    self-conditioning signal and the previous argmax canvases of the stop rule.
    """

    prompt: list[int]
    params: DecodingParams
    generator: torch.Generator
    stop_ids: tuple[int, ...]
    canvas_length: int
    steps: int  # denoising steps per canvas (N)
    entropy_bound: float
    # T for each count of remaining steps (index n), computed once on the host at admission.
    temperatures: list[float] = field(default_factory=list)
    phase: str = PREFILL
    canvas: list[int] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)
    remaining: int = 0  # denoising steps left in the current canvas (n)
    soft: torch.Tensor | None = None  # [C, d_model]: the next step's self-conditioning input
    history: list[torch.Tensor] = field(default_factory=list)  # previous argmax canvases
    answer: list[int] = field(default_factory=list)
    block: int = 0  # the canvas being denoised (0-based)
    nfe: int = 0
    committed: int = 0
    finished: bool = False
    finish_reason: str | None = None
    kv: KVPages | None = None
    drafted: int | None = None
    accepted_drafts: int | None = None
    denoise_steps: int = 0  # decoder forwards over all canvases (tokens_per_forward)
    # Structured output: the matcher of the emitted answer, and the last step's processed
    # logits ``[C, V]`` (device) that the emitted canvas is projected with.
    constraint: Constraint | None = None
    last_logits: torch.Tensor | None = None

    @property
    def step(self) -> int:
        """Denoising steps taken in the current canvas."""
        return self.steps - self.remaining if self.phase == DENOISE else 0

    @property
    def is_prefill(self) -> bool:
        return self.phase == PREFILL

    @property
    def row_length(self) -> int:
        return len(self.prompt) if self.phase == PREFILL else self.canvas_length

    @property
    def tokens_per_forward(self) -> float:
        """Answer tokens per decoder (denoising) forward, as transformers reports it."""
        return len(self.answer) / self.denoise_steps if self.denoise_steps else 0.0

    def answer_tokens(self) -> list[int]:
        """The answer so far: whole emitted canvases, cut before the first stop id."""
        return self.answer


class RenoiseDecoder:
    """The entropy-bounded renoise sampler (module docstring), batched over a step's rows.

    ``soft_embedding`` maps probabilities ``[C, V]`` to the self-conditioning signal
    ``[C, d_model]`` (the model's ``probs @ E · √H``); ``vocab_size`` is the range of the
    uniform draws (the embedding's rows, as transformers draws them). Under tensor
    parallelism ``soft_scale`` is the model's ``· √H`` of the product the ranks sum
    (:meth:`sample`).
    """

    decoding_mode = "renoise"

    def __init__(
        self,
        stop_ids: Sequence[int],
        *,
        canvas_length: int,
        vocab_size: int,
        settings: RenoiseSettings,
        soft_embedding: Callable[[torch.Tensor], torch.Tensor],
        embedding_dtype: torch.dtype,
        mask_id: int = -1,
        soft_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if canvas_length < 1 or vocab_size < 2:
            raise ValueError("a renoise canvas needs canvas_length >= 1 and vocab_size >= 2")
        self.stop_ids = tuple(stop_ids)
        self.canvas_length = canvas_length
        self.vocab_size = vocab_size
        self.settings = settings
        self.soft_embedding = soft_embedding
        self.soft_scale = soft_scale
        self.embedding_dtype = embedding_dtype
        self.mask_id = mask_id  # never drawn on purpose; only a client stop id is refused
        # Structured output: the model's grammar compiler (decoding/registry.py sets it where
        # response_format is enforced). None: response_format refused.
        self.grammar: TokenGrammar | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def canvases(self, params: DecodingParams) -> int:
        """Canvases a request may need: its answer limit in whole canvases."""
        return -(-params.gen_length // self.canvas_length)

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        # Every canvas, the last included, is forwarded at its positions (its decoder passes
        # write their throw-away K/V there), so the reservation covers them all.
        return prompt_len + self.canvases(params) * self.canvas_length

    # Prefix reuse (protocol.PrefixReuse): the encoder is causal, so the K/V of the prompt and
    # of every committed canvas depend on the tokens up to them only.
    prefix_alignment = 1

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """All of the prompt but its last token, whose encoder pass starts the first canvas."""
        return prompt_len - 1

    def reuse_prefix(self, state: RenoiseState, tokens: int) -> None:
        """The prefill forwards the prompt past the cached ``tokens`` only."""
        assert state.kv is not None and state.kv.length == tokens and state.phase == PREFILL

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> RenoiseState:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("DiffusionGemma needs a non-empty prompt (the encoder's context)")
        steps = params.steps
        if not 1 <= steps <= self.settings.max_denoising_steps:
            raise ValueError(
                f"num_denoising_steps must be in [1, {self.settings.max_denoising_steps}]"
            )
        # The canvas and renoise draws are the algorithm itself, not an optional temperature
        # draw: a generator always (seeded from the request's seed, else fresh entropy).
        generator = new_generator(_sampling(params), device)
        assert generator is not None
        bound = params.entropy_bound
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        return RenoiseState(
            prompt=prompt,
            params=params,
            generator=generator,
            constraint=request_constraint(self.grammar, params.grammar, stop_ids),
            stop_ids=stop_ids,
            canvas_length=self.canvas_length,
            steps=steps,
            entropy_bound=self.settings.entropy_bound if bound is None else bound,
            temperatures=[0.0]
            + [schedule_temperature(self.settings, n, steps) for n in range(1, steps + 1)],
        )

    def prepare(self, state: RenoiseState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        kv, c = state.kv, self.canvas_length
        if state.phase == PREFILL:  # the prompt past what a prefix-cache hit holds
            cached = kv.length
            p = len(state.prompt)
            return RowSpec(
                state.prompt[cached:], cached, [p - 1 - cached], AttentionKind.CAUSAL, kv
            )
        start = kv.length  # the committed prefix: prompt and every emitted canvas
        if state.phase == COMMIT:
            return RowSpec(state.argmax, start, [c - 1], AttentionKind.CAUSAL, kv)
        return RowSpec(
            state.canvas, start, list(range(c)), AttentionKind.BIDIRECTIONAL, kv,
            model_input=state.soft,
        )  # fmt: skip

    # ---- the batched step ----------------------------------------------------------------------
    def sample(
        self, states: Sequence[RenoiseState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """``[R, 2C + 1]`` on the device: each row's next canvas, its argmax canvas and its
        stop flag (encoder rows: the next canvas' initial noise, zeros after). Nothing is read
        back; the rows' draws come from their own generators.

        The rows are processed one after another (a fixed ~20 kernels each), not stacked: a
        row's full-vocabulary work is ``[C, V]`` fp32 (268 MB for the released 256 × 262144)
        and the softmax, entropy and sort make a few such temporaries, so stacking rows would
        multiply the step's transient memory by the batch for no fewer FLOPs (vLLM tiles its
        DiffusionGemma sampler over requests for the same reason).

        **Tensor parallelism** (the logits sharded by vocabulary): each denoising row's logits
        are gathered whole on rank 0 (``ShardedLogits.dense``, one row at a time for the
        memory reason above), and the dense code below runs on them unchanged, drawing from
        the request's generator on rank 0, so a seeded request gives its TP = 1 answer. The
        self-conditioning product ``softmax(ℓ) @ E`` is summed over the ranks, each holding
        its vocabulary slice of the logits and of ``E`` (``engine/parallel/vocab.py``), then
        scaled here; the signal reaches the workers with the row's next forward. Cost per
        denoising row and step: the whole row, ``(N − 1)/N · C · V`` fp32 gathered to rank 0
        (at TP 2 with the released 256 × 262144: 134 MB), plus ``(N − 1) · C · D`` for the
        product and ``C · D`` sent back with the rows."""
        step = as_step_logits(logits)
        sharded = step.sharded if step.flat is None else None
        soft_product = getattr(sharded, "soft_product", None)
        if sharded is not None and (soft_product is None or self.soft_scale is None):
            raise ValueError(
                "the renoise sampler under tensor parallelism needs the logits' "
                "self-conditioning product (soft_product) and the model's soft_scale"
            )
        c, vocab = self.canvas_length, self.vocab_size
        device = step.device
        out = torch.zeros(len(states), 2 * c + 1, dtype=torch.long, device=device)
        for r, state in enumerate(states):
            gen = state.generator
            if state.phase != DENOISE:  # a fresh canvas of uniform ids
                out[r, :c] = torch.randint(0, vocab, (c,), generator=gen, device=device)
                continue
            row = step.row(r) if sharded is None else sharded.dense([r])[0, :c]
            temperature = state.temperatures[state.remaining]
            processed = row / temperature
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            drawn = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            argmax = processed.argmax(dim=-1)
            entropy = token_entropy(processed)
            accepted = entropy_bound_accept(entropy, state.entropy_bound)
            # Renoise: accepted positions take the draw, every other one a fresh uniform id
            # (transformers' accept_canvas then renoise_canvas: no position of the current
            # canvas survives as it is; the ids are drawn in the same order).
            noise = torch.randint(0, vocab, (c,), generator=gen, device=device)
            out[r, :c] = torch.where(accepted, drawn, noise)
            out[r, c : 2 * c] = argmax
            out[r, 2 * c] = self._stop(state, argmax, entropy)
            # The next step's self-conditioning: transformers casts the processed logits to the
            # embedding's dtype before its softmax (a no-op in fp32).
            cast = self.embedding_dtype if self.embedding_dtype != torch.float32 else None
            if sharded is not None:
                assert soft_product is not None and self.soft_scale is not None
                state.soft = self.soft_scale(soft_product([r], [temperature], cast)[0, :c])
            else:
                if cast is not None:
                    probs = torch.softmax(processed.to(cast), -1, dtype=torch.float32)
                state.soft = self.soft_embedding(probs)
            if state.constraint is not None:
                state.last_logits = processed  # the emitted canvas is projected with these
        return out

    def _stop(
        self, state: RenoiseState, argmax: torch.Tensor, entropy: torch.Tensor
    ) -> torch.Tensor:
        """transformers' ``StableAndConfidentStoppingCriteria`` on the device: the argmax
        canvas equals each of the previous ``S`` ones (never before ``S`` steps) and the mean
        entropy is below ``c``."""
        s = self.settings.stability_threshold
        confident = entropy.mean() < self.settings.confidence_threshold
        if s == 0:
            return confident
        if len(state.history) < s:  # transformers' history starts at -1: never stable yet
            result = torch.zeros_like(confident)
        else:
            same = torch.stack([(h == argmax).all() for h in state.history]).all()
            result = confident & same
        state.history = [*state.history, argmax][-s:]
        return result

    def commit(
        self, states: Sequence[RenoiseState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [self._commit_row(s, row) for s, row in zip(states, host, strict=True)]

    def _commit_row(self, state: RenoiseState, row: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        c = self.canvas_length
        state.nfe += 1
        if state.phase != DENOISE:
            # The prompt or the last canvas is now causal K/V: a new canvas starts from noise.
            if state.phase == COMMIT:
                state.block += 1
            state.kv.length = len(state.prompt) + state.block * c
            state.canvas = [int(t) for t in row[:c]]
            state.phase, state.remaining = DENOISE, state.steps
            state.soft, state.history = None, []
            return StepResult(committed=0, finished=False)
        state.denoise_steps += 1
        state.remaining -= 1
        state.canvas = [int(t) for t in row[:c]]
        state.argmax = [int(t) for t in row[c : 2 * c]]
        if not (row[2 * c] or state.remaining == 0):
            return StepResult(committed=0, finished=False)
        return self._emit(state)

    def _emit(self, state: RenoiseState) -> StepResult:
        """The canvas is done: its argmax tokens join the answer up to the first stop id and
        the answer limit; the request ends there, or commits the canvas and goes on. A
        constrained request's canvas is first projected onto its grammar (the module
        docstring); the projection is what the next canvas reads as context."""
        if state.constraint is not None:
            state.argmax = _grammar_canvas(state)
        tokens = state.argmax
        budget = state.params.gen_length - len(state.answer)
        stop = next((i for i, t in enumerate(tokens) if t in state.stop_ids), None)
        end = len(tokens) if stop is None else stop
        new = tokens[: min(end, budget)]
        state.answer.extend(new)
        state.committed += len(new)
        state.soft, state.history = None, []
        if stop is not None and stop <= budget:
            return self._finish(state, "stop", len(new))
        if len(state.answer) >= state.params.gen_length:
            return self._finish(state, "length", len(new))
        state.phase = COMMIT
        return StepResult(committed=len(new), finished=False, new_tokens=len(new))

    @staticmethod
    def _finish(state: RenoiseState, reason: str, new: int) -> StepResult:
        state.finished, state.finish_reason = True, reason
        return StepResult(committed=new, finished=True, finish_reason=reason, new_tokens=new)


def _grammar_canvas(state: RenoiseState) -> list[int]:
    """The last step's argmax canvas projected onto the request's grammar, left to right:
    the argmax where the grammar allows it and the text cannot end there, else the first
    token of the lookahead's best valid fill of the next positions. Every token is consumed
    by the matcher; the canvas ends at the first stop id (the text is then complete)."""
    constraint, logits = state.constraint, state.last_logits
    assert constraint is not None and logits is not None
    stops = set(state.stop_ids)
    tokens: list[int] = []
    for i, token in enumerate(state.argmax):
        if constraint.done:
            break
        decided = constraint.allows(token) and (
            token in stops or not constraint.completes_with(token)
        )
        if not decided:
            window = logits[i : i + LOOKAHEAD_DEPTH].float()
            log_p = torch.log_softmax(window, dim=-1).cpu().numpy()
            token = beam_fill(constraint, log_p, state.stop_ids)[0]
        if constraint.accept([token]) != 1:
            raise RuntimeError("structured output: the grammar rejected a projected token")
        tokens.append(token)
        if token in stops:
            break
    state.last_logits = None
    return tokens


def _sampling(params: DecodingParams) -> DecodingParams:
    """``params`` as :func:`new_generator` reads them: the renoise draws always sample, so a
    request's temperature field (which this sampler does not use) must not turn them off."""
    if params.temperature > 0:
        return params
    return DecodingParams(
        gen_length=params.gen_length, steps=params.steps, temperature=1.0, seed=params.seed
    )
