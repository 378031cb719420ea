"""The shape and numerics of a :class:`~dllm_serve.models.transformer.DecoderTransformer`."""

from __future__ import annotations

from dataclasses import dataclass

from dllm_serve.models.rope import QueryScale, RopeScaling


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (LLaDA2.x; routing math in ``models/moe.py``).

    Layers ``0 .. first_dense_layers - 1`` keep the dense SwiGLU MLP (``mlp_hidden_size``
    wide); every later layer routes each token to ``top_k`` of ``num_experts`` SwiGLU experts
    (``expert_hidden_size`` wide) chosen within the best ``topk_group`` of ``n_group`` expert
    groups, and adds one always-on shared SwiGLU (``shared_hidden_size`` wide; 0 = none).
    """

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    expert_hidden_size: int
    shared_hidden_size: int
    routed_scaling_factor: float
    first_dense_layers: int
    renormalize: bool = True  # divide the chosen experts' scores by their sum

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.n_group < 1 or self.num_experts % self.n_group:
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
        if self.first_dense_layers < 0:
            raise ValueError("first_k_dense_replace must be >= 0")

    def is_moe_layer(self, index: int) -> bool:
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
