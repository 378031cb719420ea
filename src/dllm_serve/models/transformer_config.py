"""The shape and numerics of a :class:`~dllm_serve.models.transformer.DecoderTransformer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dllm_serve.models.rope import QueryScale, RopeScaling

Routing = Literal["sigmoid_group_limited", "softmax"]
# The gated MLPs' activation: SwiGLU (``silu``; every family but Gemma) or GeGLU with the tanh
# approximation of GELU (``gelu_tanh``; Gemma's ``gelu_pytorch_tanh``).
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (routing math in ``models/routing.py``).

    Each MoE layer routes every token to ``top_k`` of ``num_experts`` SwiGLU experts
    (``expert_hidden_size`` wide) and adds an always-on shared SwiGLU (``shared_hidden_size``
    wide; 0 = none). ``routing`` picks the rule: ``"sigmoid_group_limited"`` (LLaDA2.x: biased
    sigmoid scores, the best ``topk_group`` of ``n_group`` expert groups) or ``"softmax"``
    (LLaDA-MoE: softmax over all experts, top-k). ``renormalize`` divides the chosen weights
    by their sum, ``routed_scaling_factor`` multiplies them.

    Which layers are MoE: ``moe_layers`` (one flag per layer, LLaDA-MoE's ``moe_layer_freq``)
    when given, else every layer from ``first_dense_layers`` on (LLaDA2's
    ``first_k_dense_replace``). The other layers keep the dense SwiGLU (``mlp_hidden_size``).

    Block routing (LLaDA2.2's ``expert_capacity``): with ``expert_capacity`` C set, the tokens
    of each ``routing_block`` of positions (aligned to position 0, one request's tokens) may
    use only the C experts the block admits (``models/routing.py``); None: per-token routing.
    """

    num_experts: int
    top_k: int
    expert_hidden_size: int
    shared_hidden_size: int
    routing: Routing = "sigmoid_group_limited"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_dense_layers: int = 0
    renormalize: bool = True  # divide the chosen experts' scores by their sum
    moe_layers: tuple[bool, ...] | None = None
    activation: Activation = "silu"  # the experts' gate activation
    # Expert parallelism (rank, ranks): this module holds experts rank·E/ranks … (rank+1)·E/ranks
    # − 1 only (models/sharding.py); (0, 1) holds them all.
    expert_ranks: tuple[int, int] = (0, 1)
    # LLaDA2.2 block routing: the experts one routing block may use, and the block's length
    # in positions (the checkpoint's block_size). None / 0: per-token routing.
    expert_capacity: int | None = None
    routing_block: int = 0

    @property
    def local_experts(self) -> range:
        """The ids of the experts this module holds."""
        rank, ranks = self.expert_ranks
        per = self.num_experts // ranks
        return range(rank * per, (rank + 1) * per)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if self.routing == "softmax":
            self._check_softmax()
        elif self.routing == "sigmoid_group_limited":
            self._check_grouped()
        else:
            raise ValueError(f"unknown MoE routing {self.routing!r}")
        if self.first_dense_layers < 0:
            raise ValueError("first_k_dense_replace must be >= 0")
        if self.moe_layers is not None and self.first_dense_layers:
            raise ValueError("give either moe_layers or first_dense_layers, not both")
        if self.expert_capacity is not None:
            self._check_capacity()

    def _check_capacity(self) -> None:
        capacity = self.expert_capacity
        if self.routing != "sigmoid_group_limited":
            raise ValueError("expert_capacity (block routing) needs sigmoid routing")
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise ValueError(f"expert_capacity must be an integer, got {capacity!r}")
        # Every token must find its top_k experts among the block's admitted ones.
        if not self.top_k <= capacity <= self.num_experts:
            raise ValueError(
                f"expert_capacity {capacity} must be in [num_experts_per_tok {self.top_k}, "
                f"num_experts {self.num_experts}]"
            )
        if self.routing_block < 1:
            raise ValueError("block routing (expert_capacity) needs a routing block >= 1")

    def _check_softmax(self) -> None:
        if self.n_group != 1 or self.topk_group != 1:
            raise ValueError("softmax routing has no expert groups (n_group = topk_group = 1)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, num_experts {self.num_experts}]"
            )

    def _check_grouped(self) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts {self.num_experts} must be a positive multiple of n_group "
                f"{self.n_group}"
            )
        per_group = self.num_experts // self.n_group
        if per_group < 2:
            # A group is scored by the sum of its two best experts.
            raise ValueError(f"each of the {self.n_group} expert groups needs >= 2 experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group {self.n_group}]")
        if not 1 <= self.top_k <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, {self.topk_group * per_group}] "
                f"(the experts of topk_group {self.topk_group} groups)"
            )

    def is_moe_layer(self, index: int) -> bool:
        if self.moe_layers is not None:
            return self.moe_layers[index]
        return index >= self.first_dense_layers


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and numerics of a :class:`DecoderTransformer`, independent of checkpoint format."""

    vocab_size: int  # rows of the embedding / LM head (LLaDA: embedding_size)
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    max_sequence_length: int
    head_dim: int = 0  # 0: d_model // n_heads (Qwen3 may set it independently)
    qkv_bias: bool = False  # Qwen2/Dream: biases on q/k/v
    o_bias: bool = False  # Qwen3 attention_bias=true: biases on q/k/v *and* o
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    rope_scaling: RopeScaling | None = None  # None: plain RoPE with rope_theta
    # Partial RoPE (LLaDA2): only the first ``rotary_dim`` dims of each head rotate, the rest
    # pass through; 0 = head_dim (every dim rotates).
    rotary_dim: int = 0
    # The checkpoint stores q/k/v as one ``[q heads | k heads | v heads]`` projection (LLaDA2's
    # ``query_key_value``), so the module is built fused instead of fused after loading.
    fused_qkv: bool = False
    moe: MoEConfig | None = None  # None: every layer has the dense MLP
    # Llama-4 query scaling after RoPE (Ministral3 / Nemotron-Labs-Diffusion); None: off.
    query_scale: QueryScale | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_sequence_length, int) or self.max_sequence_length < 2:
            # A context that holds no prompt plus an answer would refuse every request.
            raise ValueError(
                f"the context length (max_sequence_length / max_position_embeddings) must be "
                f"an integer >= 2, got {self.max_sequence_length!r}"
            )
        if not self.head_dim:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]"
            )
        moe_layers = self.moe.moe_layers if self.moe is not None else None
        if moe_layers is not None and len(moe_layers) != self.n_layers:
            raise ValueError(
                f"the MoE layer pattern has {len(moe_layers)} entries for {self.n_layers} layers"
            )
