"""Fast-dLLM v2 (``model_type: Fast_dLLM_Qwen``): block diffusion adapted from Qwen2.5.

The released 7B (``Efficient-Large-Model/Fast_dLLM_v2_7B``) is Qwen2.5-7B-Instruct fine-tuned
to denoise blocks of ``bd_size`` = 32 tokens: the weights keep Qwen2's names and shapes (q/k/v
biases, no o bias, untied head), attention at inference is block-causal over blocks aligned to
position 0 (``eval_block_diff_mask``: a query in block ``i`` sees keys in blocks ``≤ i``), and
the logits are read with a **token shift**: position ``j``'s distribution is the output at
``j − 1``, as in the autoregressive model it came from. Its ``generate`` decodes each block in
sub-blocks of 8 (``small_block_size``), left to right (``decoding/fast_dllm.py``).

Tokens: mask ``|<MASK>|`` (151665 in the real tokenizer; config.json has no ``mask_token_id``,
so the id is the tokenizer's), end of turn ``<|im_end|>`` (the config's EOS, 151645) and
``<|endoftext|>`` (generation_config's second EOS, 151643): both stop an answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.families.base import UnsupportedModelError
from dllm_serve.models.families.qwen import QwenFamily

# Fast_dLLM_QwenConfig's default bd_size, and the released 7B's.
DEFAULT_BLOCK = 32
# generate()'s small_block_size (also its chatbot's and SGLang's HierarchyBlock sub_block_size).
SUB_BLOCK = 8


@dataclass(frozen=True)
class FastDLLMFamily(QwenFamily):
    """Fast-dLLM v2 checkpoints (see the module docstring).

    ``sub_block_size``: the span one denoising step commits in, fixed by the official decoding
    loop (not a checkpoint key); the block must hold a whole number of them.
    """

    sub_block_size: int = SUB_BLOCK

    def check(self, config: Mapping[str, Any]) -> None:
        super().check(config)
        size = config.get("bd_size", DEFAULT_BLOCK)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UnsupportedModelError(
                f"Fast-dLLM v2 config.json: bd_size must be a positive integer, got {size!r}"
            )
        if size % self.sub_block_size:
            # The official loop decodes the block in bd_size // 8 sub-blocks; a remainder would
            # never be decoded (its generate() loops forever on such a block).
            raise UnsupportedModelError(
                f"Fast-dLLM v2 config.json: bd_size {size} is not a multiple of the sub-block "
                f"of {self.sub_block_size} tokens its decoding loop commits in"
            )
        # Keys that state another family's attention: the config cannot mean both.
        other = config.get("block_size")
        if other is not None and other != size:
            raise UnsupportedModelError(
                f"ambiguous config.json: bd_size {size} (Fast-dLLM v2's block) and block_size "
                f"{other!r} (SDAR's / LLaDA2's) disagree; keep the one the checkpoint was "
                "trained with"
            )
        if "use_regular_causal" in config:
            raise UnsupportedModelError(
                "ambiguous config.json: model_type Fast_dLLM_Qwen with use_regular_causal "
                "(an SDAR / I-DLM attention key); remove it if this is a Fast-dLLM v2 checkpoint"
            )

    def block_size(self, config: Mapping[str, Any], block_length: int | None) -> int | None:
        """``bd_size`` (absent: 32, the config class's default); generation_config's
        ``block_length`` is not read: the block is what the model was trained with."""
        return int(config.get("bd_size", DEFAULT_BLOCK))


FAST_DLLM = FastDLLMFamily(
    name="fastdllm",
    bidirectional=True,  # inside a block; causal across blocks (block_diffusion)
    logit_shift=True,
    mask_token="|<MASK>|",
    eot_token="<|im_end|>",
    model_types=("fast_dllm_qwen",),
    architectures=("Fast_dLLM_QwenForCausalLM",),
    description="Fast-dLLM v2 (Qwen2.5 block diffusion, token shift)",
    extra_stop_tokens=("<|endoftext|>",),
    tokenizer_class="Qwen2Tokenizer",
    qkv_bias=True,
    block_diffusion=True,
)
