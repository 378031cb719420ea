"""Count what one engine step costs on the host: device→host syncs and aten ops.

Not collected by pytest (no ``test_`` prefix). A :class:`StepCounter` is a
``TorchDispatchMode`` that sees every aten op the step dispatches; ``tolist``/``numpy`` (which
read tensor memory without dispatching an op on CPU) are patched to count too: on CUDA each of
these is a point where the host waits for the device. ``numpy`` of a CPU tensor is counted
apart (``host_views``): it cannot be a device read (CUDA tensors refuse it), and the CPU sampler
uses it for NumPy's faster argmax on the same memory.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read a device value back to the host (or must, to size their output).
SYNC_OPS = {
    "aten._local_scalar_dense.default",  # .item(), int(t), float(t), bool(t)
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.equal.default",
    "aten.repeat_interleave.Tensor",
}


class StepCounter(TorchDispatchMode):
    """``syncs``: device→host reads; ``ops``: non-view aten ops by name; ``host_tensors``:
    tensors built from host data (``torch.tensor(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.host_tensors = 0
        self.host_views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in SYNC_OPS:
            self.syncs[name] += 1
        if name == "aten.index.Tensor" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.syncs["boolean indexing"] += 1
        if name == "aten.lift_fresh.default":
            self.host_tensors += 1
        if not func.is_view:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> StepCounter:
        self._saved = (torch.Tensor.tolist, torch.Tensor.numpy)
        counter = self

        def tolist(t: torch.Tensor) -> Any:
            counter.syncs["tolist"] += 1
            return counter._saved[0](t)

        def numpy(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if t.device.type == "cpu":
                counter.host_views += 1
            else:
                counter.syncs["numpy"] += 1
            return counter._saved[1](t, *a, **k)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        torch.Tensor.numpy = numpy  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved  # type: ignore[method-assign]
        super().__exit__(*exc)

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())
