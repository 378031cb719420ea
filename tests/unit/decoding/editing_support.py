"""What the token-editing engine tests share (LLaDA2.1's JointThreshold, test_decoding_editing.py,
and LLaDA2.2's JointThresholdInDel, test_decoding_indel.py): the prompts and the rule settings
their engine == re-statement tests run."""

from __future__ import annotations

# τ_mask 0.002 commits several masks in some steps and one in others, and its argmax at a
# committed position often moves as the block fills in: edits fire.
TAU_MASK = 0.002


def prompts(b: int) -> list[list[int]]:
    """Prompt lengths ≡ 0, 1 and B-1 (mod B), and shorter than a block."""
    return [list(range(11, 11 + n)) for n in (2 * b, 2 * b + 1, 2 * b - 1, 2)]


SETTINGS = {
    # S mode's edit threshold (any different argmax is an edit), budget 16 and a tight 2.
    "s-mode": {"confidence_threshold": TAU_MASK, "edit_threshold": 0.0},
    "budget-2": {"confidence_threshold": TAU_MASK, "edit_threshold": 0.0, "max_post_edit_steps": 2},
    # τ_mask left at its default (0.5: always the top-1 fallback here), edits above 0.0021.
    "default-mask": {"edit_threshold": 0.0021},
    "no-post-steps": {"confidence_threshold": TAU_MASK, "edit_threshold": 0.0,
                      "max_post_edit_steps": 0},
}  # fmt: skip
