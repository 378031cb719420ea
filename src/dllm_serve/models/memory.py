"""Will the weights fit? Estimate their bytes from the config and compare with what the device
has free *before* reading any, so an oversized model fails at once with a clear message
instead of being killed half-way through loading.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dllm_serve.models.errors import InsufficientMemoryError
from dllm_serve.models.network import build_network
from dllm_serve.models.transformer import TransformerConfig

SKIP_ENV = "DLLM_SERVE_SKIP_MEMORY_CHECK"


def weight_bytes(tcfg: TransformerConfig, dtype: torch.dtype) -> tuple[int, int]:
    """``(total, largest tensor)`` bytes of the network's weights in ``dtype``."""
    with torch.device("meta"):  # shapes only, no allocation
        sizes = [p.numel() for p in build_network(tcfg).parameters()]
    item = torch.empty((), dtype=dtype).element_size()
    return sum(sizes) * item, max(sizes) * item


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_available() -> int | None:
    """Room left under a container's memory limit (cgroup v2, then v1), if there is one."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        # v1 reports "no limit" as a huge number; anything above 2**60 means unlimited.
        if limit is not None and usage is not None and limit < 2**60:
            return max(limit - usage, 0)
    return None


def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes, or None when it cannot be determined."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        found = [n for n in (_host_available(), _cgroup_available()) if n is not None]
        return min(found) if found else None
    return None


def check_memory(tcfg: TransformerConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Raise :class:`InsufficientMemoryError` when the weights cannot fit; return their bytes.

    Needed: all weights plus the largest tensor once more (a tensor is read in the file's
    dtype and then converted). Activations and KV caches come on top and are not counted.
    Set ``DLLM_SERVE_SKIP_MEMORY_CHECK=1`` to load anyway (swap, unified memory, …).
    """
    total, largest = weight_bytes(tcfg, dtype)
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return total
    free = available_bytes(device)
    if free is not None and total + largest > free:
        gib = 2**30
        raise InsufficientMemoryError(
            f"the weights need {total / gib:.2f} GiB in {str(dtype).removeprefix('torch.')} "
            f"(+{largest / gib:.2f} GiB while converting) but {device} has only "
            f"{free / gib:.2f} GiB free; use a smaller --dtype, another --device, or set "
            f"{SKIP_ENV}=1 to try anyway"
        )
    return total
