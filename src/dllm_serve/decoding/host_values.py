"""Host values onto the device without making the host wait for it.

``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` copy blocking: PyTorch then
synchronises the stream, so the host waits until every kernel already queued has run — in a
step's sampler, the whole forward — and the sampler's remaining launches stop overlapping the
device's work. A non-blocking copy from ordinary (pageable) host memory is not enough either:
the driver may stage it through a stream synchronisation of its own. So on CUDA the values are
first put in pinned memory (PyTorch's caching host allocator: reused, and kept alive until the
copy that reads it has run) and copied non-blocking; stream order puts the copy before any
kernel that reads it. Elsewhere (CPU, and the meta device of the device-safety tests) the copy
is the same call without the pinning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host``, in pinned memory when it is bound for CUDA: the source of a
    ``non_blocking=True`` copy (``.to`` or ``copy_``) that never waits."""
    return host.pin_memory() if device.type == "cuda" else host


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device`` without a host wait (itself when on the CPU)."""
    return staged(host, device).to(device, non_blocking=True)


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` (see :func:`host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)
