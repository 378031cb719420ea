"""What a request asks of the decoder, torch-free so the API layer can build it: the
decoding modes a client may name, :class:`DecodingParams`, a request's stop ids, and the
block-size tiers that shrink a self-speculative stride under load.

**Modes.** A tri-mode model (Nemotron-Labs-Diffusion) decodes one set of weights three ways,
chosen per request: ``ar`` (causal, one token per forward), ``diffusion`` (block diffusion over
a causal prefix) and ``linear_spec`` (diffusion draft, causal verify). Every other model has
exactly one mode: ``diffusion`` for the denoising and block-diffusion families, ``isd`` for
I-DLM's introspective strided decoding. An algorithm names its kind (``decoding_mode`` of
:class:`~dllm_serve.decoding.protocol.DecodingAlgorithm`); :func:`model_mode` maps that kind
to the mode a client may name.

**Block-size tiers.** SGLang's ``block_size_tiers`` idea (its I-DLM serving path): a wide
speculative round costs 2N−1 query tokens per request for at most N emitted tokens, which pays
off when the GPU is idle but wastes compute when many rows share a forward. A tier table maps the
number of running requests to the stride: ``"1:8,8:4,32:2"`` means N = 8 from 1 running
request, 4 from 8, 2 from 32 (below the smallest threshold the server's ``--isd-stride``
applies).

Tiers apply only to self-speculation: the ISD stride N, and for tri-mode models LinearSpec's
block B (``linear_spec.py``; the default is then the checkpoint's block). Both
verifications are exact, so a request's answer does not depend on N or B (greedy:
token-identical; sampling: same distribution). They never touch a LLaDA ``block_length``,
which is part of what the client asked for. The KV reservation of
each request is sized for :attr:`BlockSizeTiers.max_stride`, so shrinking or growing the
stride never reallocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# ---- modes -------------------------------------------------------------------------------------


AR = "ar"
DIFFUSION = "diffusion"
LINEAR_SPEC = "linear_spec"
ISD = "isd"
TRI_MODES = (AR, DIFFUSION, LINEAR_SPEC)
REQUEST_MODES = (AR, DIFFUSION, LINEAR_SPEC, ISD)
DEFAULT_TRI_MODE = LINEAR_SPEC  # exact like ar, fewer forwards per token on a trained model

TRI_MODE = "tri_mode"  # the algorithm kind of a tri-mode model (several modes)
_ONE_MODE = {
    "diffusion": DIFFUSION,
    "block_diffusion": DIFFUSION,
    "self_speculation": ISD,
    "renoise": DIFFUSION,  # DiffusionGemma's uniform-state canvases (decoding/renoise.py)
}

DESCRIPTIONS = {
    AR: "autoregressive: causal decoding with a KV cache, one token per forward",
    DIFFUSION: "diffusion: masked positions denoised in parallel",
    LINEAR_SPEC: "LinearSpec: a block drafted in the diffusion view, verified causally",
    ISD: "I-DLM introspective strided decoding (exact self-speculation)",
}


def model_mode(kind: str) -> str:
    """The one request mode of a single-mode algorithm kind (``diffusion``, ``isd``)."""
    try:
        return _ONE_MODE[kind]
    except KeyError:
        raise ValueError(f"algorithm kind {kind!r} has no single decoding mode") from None


# ---- decoding parameters -----------------------------------------------------------------------


BLOCK_SCHEDULES = ("uniform", "front_loaded", "cosine")
CONFIDENCE_METRICS = ("top1_prob", "entropy_inverse")
DEFAULT_GEN_LENGTH = 128  # canvas of a request without max_tokens, unless the model sets one
DEFAULT_STEPS = 128  # docs/api-contract.md; capped at the canvas
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound
DEFAULT_POST_EDIT_STEPS = 16  # JointThreshold's mask-free edit steps per block (SGLang's default)
EDIT_MASK_THRESHOLD = 0.5  # JointThreshold's τ_mask when confidence_threshold is not set
# --decoding-algorithm: the commit rule of requests that choose none (they set none of
# RULE_FIELDS), as request fields. The editing presets are LLaDA2.1's published S and Q modes;
# the entropy ones SGLang's EBSampling and EntropyThreshold defaults.
DECODING_ALGORITHMS: dict[str, dict[str, float]] = {
    "low_confidence": {},  # the request's own fields (top-k by default)
    "s_mode": {"confidence_threshold": 0.5, "edit_threshold": 0.0},
    "q_mode": {"confidence_threshold": 0.7, "edit_threshold": 0.5},
    "eb_sampler": {"entropy_bound": 0.15},
    "entropy_threshold": {"entropy_threshold": 0.95},
}
EDITING_ALGORITHMS = ("s_mode", "q_mode")
RULE_FIELDS = ("confidence_threshold", "use_local_leap", "entropy_bound", "entropy_threshold",
               "edit_threshold")  # fmt: skip
COMMIT_RULES = ("topk", "threshold", "local_leap", "entropy_bound", "entropy_threshold",
                "joint_threshold")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodingParams:
    """How one request is denoised.

    The canvas of ``gen_length`` masked positions is split into ``gen_length // block_length``
    blocks decoded left to right (LLaDA's semi-autoregressive sampling). ``temperature == 0``
    is greedy (argmax); otherwise tokens are drawn by Gumbel-max in float64 from a generator
    seeded with ``seed``. Positions are ranked by ``confidence_metric`` (both metrics are on
    the scale ``(0, 1]``, see ``sampler.py``).

    How many positions a step commits (``mode``):

    - ``"topk"`` (default): each block gets ``steps // num_blocks`` steps and
      ``block_schedule`` says how many of its masks each step commits.
    - ``"threshold"`` (``confidence_threshold`` set; Fast-dLLM): every masked position of the
      block with confidence ≥ the threshold, and always the most confident one.
    - ``"local_leap"`` (``use_local_leap``; arXiv:2510.07081): the threshold rule at
      ``local_leap_anchor_threshold`` (κ), plus positions with confidence ≥
      ``local_leap_neighbor_threshold`` (τ ≤ κ) within ``local_leap_radius`` (W) of a κ-anchor.
    - ``"entropy_bound"`` (``entropy_bound`` γ; the EB-sampler): the lowest-entropy masks
      while the entropies taken before each sum to at most γ.
    - ``"entropy_threshold"`` (``entropy_threshold``; d3LLM): every mask whose entropy is
      below it (nats), and always the lowest.
    - ``"joint_threshold"`` (``edit_threshold`` set; LLaDA2.1 token editing, block-diffusion
      models whose family allows it): masks above τ_mask (``confidence_threshold``, else
      0.5; strictly) or the most confident one, plus edits of unmasked positions of the open
      block above τ_edit; up to ``max_post_edit_steps`` mask-free edit steps per block.

    In the data-dependent modes a block ends when it has no masks left (at most
    ``block_length`` forwards; editing adds its post-edit steps); ``steps`` only has to be a
    multiple of the block count (as upstream) and ``block_schedule`` must stay ``"uniform"``
    (it would have no effect). The entropy modes rank by entropy whatever
    ``confidence_metric`` says.
    """

    gen_length: int = DEFAULT_GEN_LENGTH
    steps: int = DEFAULT_STEPS
    block_length: int | None = None  # None: one block covering the whole canvas
    temperature: float = 0.0
    seed: int | None = None
    block_schedule: str = "uniform"
    confidence_metric: str = "top1_prob"
    force_single_batch: bool = False
    confidence_threshold: float | None = None  # None: off (fixed-step top-k decoding)
    use_local_leap: bool = False
    local_leap_anchor_threshold: float = 0.9  # κ
    local_leap_neighbor_threshold: float = 0.75  # τ
    local_leap_radius: int = 4  # W
    # The EB-sampler's bound γ on the entropies committed per step (nats), and d3LLM's
    # entropy threshold (nats); None: off. DiffusionGemma's renoise sampler
    # (decoding/renoise.py) reads entropy_bound as its acceptance bound (None: the
    # checkpoint's generation_config.json); ``steps`` is then the denoising steps per canvas
    # and ``gen_length`` the answer limit across canvases.
    entropy_bound: float | None = None
    entropy_threshold: float | None = None
    # LLaDA2.1 token editing (JointThreshold): τ_edit, and the mask-free steps a block may
    # spend on edits. None: off. τ_mask is confidence_threshold (else EDIT_MASK_THRESHOLD).
    edit_threshold: float | None = None
    max_post_edit_steps: int = DEFAULT_POST_EDIT_STEPS
    # Per-request stop set: ignore_eos drops the model's stop ids (EOS/EOT), so the whole
    # canvas is decoded unless one of stop_token_ids (stop ids the client adds) ends it.
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Tri-mode models (the modes above): "ar", "diffusion" or "linear_spec"; None: the
    # server's default. Single-mode models accept only their own mode (checked by the API).
    decoding_mode: str | None = None
    # The answer keeps at most this many tokens (None: the whole canvas). The server sets it
    # when it rounds a canvas up to whole blocks (api/rules.py): the canvas is then
    # decoded as usual and its positions past the limit are dropped. Canvas denoising only.
    answer_limit: int | None = None
    # Infilling (/v1/completions suffix; canvas denoising of bidirectional models): token ids
    # after the canvas, which the canvas attends to and is decoded between the prompt and.
    suffix_ids: tuple[int, ...] = ()
    # Log-probabilities of the answer tokens from their committing forwards, with this many
    # alternatives each (0-20); None: off (engine/logprobs.py).
    logprobs: int | None = None
    # Structured output (response_format): llguidance grammar text the answer must match
    # (decoding/grammar.py); None: free text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Whole numbers only: 16.0 would pass every range check and fail deep in a decoder.
        for name in ("gen_length", "steps", "block_length", "seed", "answer_limit"):
            value = getattr(self, name)
            if value is None and name not in ("gen_length", "steps"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.gen_length < 1:
            raise ValueError("gen_length must be >= 1")
        if self.block_length is None:
            object.__setattr__(self, "block_length", self.gen_length)
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if not 1 <= self.block_length <= self.gen_length:
            raise ValueError("block_length must be in [1, gen_length]")
        if self.gen_length % self.block_length:
            raise ValueError("block_length must divide gen_length")
        if self.steps % self.num_blocks:
            raise ValueError("the number of blocks must divide steps")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if self.block_schedule not in BLOCK_SCHEDULES:
            raise ValueError(f"block_schedule must be one of {BLOCK_SCHEDULES}")
        if self.confidence_metric not in CONFIDENCE_METRICS:
            raise ValueError(f"confidence_metric must be one of {CONFIDENCE_METRICS}")
        if self.decoding_mode is not None and self.decoding_mode not in REQUEST_MODES:
            raise ValueError(f"decoding_mode must be one of {REQUEST_MODES}")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
            and 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):  # fmt: skip
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None")
        if self.answer_limit is not None and not 1 <= self.answer_limit <= self.gen_length:
            raise ValueError("answer_limit must be in [1, gen_length]")
        self._check_commit_rule()

    def _check_commit_rule(self) -> None:
        if self.confidence_threshold is not None and not 0.0 < self.confidence_threshold <= 1.0:
            raise ValueError("confidence_threshold must be in (0, 1]")
        kappa, tau = self.local_leap_anchor_threshold, self.local_leap_neighbor_threshold
        if not (0.0 <= kappa <= 1.0 and 0.0 <= tau <= 1.0):
            raise ValueError("LocalLeap thresholds must be in [0, 1]")
        if tau > kappa:
            # With τ > κ "commit c ≥ κ, or c ≥ τ near an anchor" and the authors' per-position
            # form "threshold τ near an anchor, else κ" disagree; τ ≤ κ is the meaningful case.
            raise ValueError(
                "local_leap_neighbor_threshold must not exceed local_leap_anchor_threshold"
            )
        if self.local_leap_radius < 0:
            raise ValueError("local_leap_radius must be >= 0")
        if self.use_local_leap and self.confidence_threshold is not None:
            raise ValueError(
                "use_local_leap and confidence_threshold are mutually exclusive: LocalLeap's "
                "anchor threshold is its confidence threshold"
            )
        self._check_entropy_and_edit_rules()
        if self.mode != "topk" and self.block_schedule != "uniform":
            raise ValueError(
                "block_schedule applies to fixed-step decoding only; threshold and LocalLeap "
                "decoding commit a data-dependent number of tokens per step"
            )

    def _check_entropy_and_edit_rules(self) -> None:
        if self.entropy_bound is not None and not 0.0 <= self.entropy_bound <= 1000.0:
            raise ValueError("entropy_bound must be in [0, 1000] (nats)")
        if self.entropy_threshold is not None and not 0.0 < self.entropy_threshold <= 1000.0:
            raise ValueError("entropy_threshold must be in (0, 1000] (nats)")
        if self.edit_threshold is not None and not 0.0 <= self.edit_threshold <= 1.0:
            raise ValueError("edit_threshold must be in [0, 1]")
        steps = self.max_post_edit_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= 1024:
            raise ValueError("max_post_edit_steps must be an integer in [0, 1024]")
        rules = [
            name
            for name, on in (
                ("use_local_leap", self.use_local_leap),
                ("entropy_bound", self.entropy_bound is not None),
                ("entropy_threshold", self.entropy_threshold is not None),
                # JointThreshold reads confidence_threshold as its τ_mask.
                ("confidence_threshold", self.confidence_threshold is not None
                 and self.edit_threshold is None),
                ("edit_threshold", self.edit_threshold is not None),
            )
            if on
        ]  # fmt: skip
        if len(rules) > 1:
            raise ValueError(f"{' and '.join(rules)} choose different commit rules; set one")

    @property
    def mode(self) -> str:
        """The commit rule, one of :data:`COMMIT_RULES`."""
        if self.use_local_leap:
            return "local_leap"
        if self.edit_threshold is not None:
            return "joint_threshold"
        if self.entropy_bound is not None:
            return "entropy_bound"
        if self.entropy_threshold is not None:
            return "entropy_threshold"
        return "topk" if self.confidence_threshold is None else "threshold"

    @property
    def mask_threshold(self) -> float:
        """JointThreshold's τ_mask: ``confidence_threshold``, else 0.5 (SGLang's default)."""
        if self.confidence_threshold is None:
            return EDIT_MASK_THRESHOLD
        return self.confidence_threshold

    @property
    def num_blocks(self) -> int:
        assert self.block_length is not None  # resolved in __post_init__
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def answer_budget(self) -> int:
        """The most answer tokens a request may return: its limit, else the whole canvas."""
        return self.gen_length if self.answer_limit is None else self.answer_limit


# ---- stop ids ----------------------------------------------------------------------------------


def request_stop_ids(
    mask_id: int, model_stop_ids: Sequence[int], params: DecodingParams
) -> tuple[int, ...]:
    """The ids that end this request's answer: the model's (EOS, end of turn) plus
    ``params.stop_token_ids``. ``ignore_eos`` drops only the model's, as in vLLM: ids the
    client asked for still end the answer. Raises ValueError when the request names the mask
    id as a stop id (every masked position would read as a stop)."""
    if mask_id in params.stop_token_ids:
        raise ValueError("the mask id cannot be a stop id")
    if params.ignore_eos:
        return tuple(params.stop_token_ids)
    return (*model_stop_ids, *params.stop_token_ids)


# ---- block-size tiers --------------------------------------------------------------------------


DEFAULT_ISD_STRIDE = 4  # I-DLM's stride N when --isd-stride is not given


@dataclass(frozen=True, slots=True)
class BlockSizeTiers:
    """An ordered tier table ``((min_running, stride), ...)`` plus the default stride."""

    default: int
    tiers: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.default < 1:
            raise ValueError("the ISD stride must be >= 1")
        thresholds = [t for t, _ in self.tiers]
        strides = [s for _, s in self.tiers]
        if any(t < 1 for t in thresholds) or any(s < 1 for s in strides):
            raise ValueError("block-size tiers need thresholds >= 1 and strides >= 1")
        if thresholds != sorted(set(thresholds)):
            raise ValueError("block-size tier thresholds must be strictly increasing")
        if strides != sorted(strides, reverse=True):
            # Tiers exist to shrink the stride as load grows; a growing table is a typo.
            raise ValueError("block-size tier strides must not increase with the threshold")

    @property
    def max_stride(self) -> int:
        """The widest stride any load can select (what the KV budget is sized for)."""
        return max([self.default, *(s for _, s in self.tiers)])

    def stride_for(self, running: int) -> int:
        """The stride for ``running`` concurrent requests: the last tier whose threshold is
        ≤ ``running``, else the default."""
        stride = self.default
        for threshold, tier_stride in self.tiers:
            if running >= threshold:
                stride = tier_stride
        return stride


def parse_tiers(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:8,8:4,32:2"`` → ``((1, 8), (8, 4), (32, 2))``; empty text → no tiers."""
    tiers: list[tuple[int, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        threshold, sep, stride = item.partition(":")
        if not sep:
            raise ValueError(f"block-size tier {item!r} is not THRESHOLD:STRIDE")
        try:
            tiers.append((int(threshold), int(stride)))
        except ValueError:
            raise ValueError(f"block-size tier {item!r} is not THRESHOLD:STRIDE") from None
    BlockSizeTiers(1, tuple(tiers))  # validate
    return tuple(tiers)
