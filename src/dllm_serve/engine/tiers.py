"""Block-size tiers: shrink the I-DLM self-speculative stride N under concurrency.

SGLang's ``block_size_tiers`` idea (its I-DLM serving path): a wide speculative
round costs 2N−1 query tokens per request for at most N emitted tokens, which pays off when
the GPU is idle but wastes compute when many rows share a forward. A tier table maps the
number of running requests to the stride: ``"1:8,8:4,32:2"`` means N = 8 from 1 running
request, 4 from 8, 2 from 32 (below the smallest threshold the server's ``--isd-stride``
applies).

Tiers apply only to self-speculation: the ISD stride N, and for tri-mode models LinearSpec's
block B (``decoding/linear_spec.py``; the default is then the checkpoint's block). Both
verifications are exact, so a request's answer does not depend on N or B (greedy:
token-identical; sampling: same distribution). They never touch a LLaDA ``block_length``,
which is part of what the client asked for. The KV reservation of
each request is sized for :attr:`BlockSizeTiers.max_stride`, so shrinking or growing the
stride never reallocates.
"""

from __future__ import annotations

from dataclasses import dataclass

ISD_FAMILIES = ("sdar",)  # families served by self-speculation (I-DLM)


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
