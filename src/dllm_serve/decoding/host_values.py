"""Host values onto the device without making the host wait for it.

``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` copy blocking: PyTorch then
synchronises the stream, so the host waits until every kernel already queued has run — in a
step's sampler, the whole forward — and the sampler's remaining launches stop overlapping the
device's work. A non-blocking copy from ordinary (pageable) host memory is staged by the
driver before the call returns, so the host list may be dropped at once, and stream order
still puts the copy before any kernel that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, copied non-blocking."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
