"""The shape and numerics of a :class:`~dllm_serve.models.transformer.DecoderTransformer`."""

from __future__ import annotations

from dataclasses import dataclass

from dllm_serve.models.rope import RopeScaling


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
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
