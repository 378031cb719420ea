"""A dispatch mode that holds code to the device: what a CUDA step must not do, seen on CPU.

Not collected by pytest (no ``test_`` prefix). Run the code under test on PyTorch's meta device
(tensors with shapes and no data, so any op that needs a value raises) inside
:class:`DeviceOnly`, which fails:

- an op that reads a device value back (``step_counter.SYNC_OPS``: ``.item()``, ``nonzero``…);
- an op handed a tensor of another device (a host tensor mixed into device work: on CUDA an
  error, or for an index a copy on every call), 0-d tensors aside (kernels take them as
  scalars);
- with ``allow_transfers``, explicit host→device copies (``.to(device)``, ``copy_``) are
  allowed only non-blocking: a blocking one is a stream sync on CUDA (the host waits for all
  queued work, the forward included), and so is ``torch.tensor(data, device=...)``;
  without it, any transfer fails (inside a captured graph none may happen).
"""

from __future__ import annotations

from typing import Any

import torch
from step_counter import SYNC_OPS
from torch.utils._python_dispatch import TorchDispatchMode

TRANSFERS = frozenset({"aten._to_copy.default", "aten.copy_.default"})


class DeviceOnly(TorchDispatchMode):
    """Fails device reads, host tensors in device ops and (optionally) blocking transfers."""

    def __init__(self, device: torch.device, *, allow_transfers: bool = False) -> None:
        super().__init__()
        self.device = device
        self.allow_transfers = allow_transfers
        self.ops = 0
        self.transfers = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name, kwargs = str(func), kwargs or {}
        if name in SYNC_OPS:
            raise AssertionError(f"{name} reads a device value back")
        if name == "aten.lift_fresh.default":
            pass  # a host tensor made from Python data: harmless until a device op takes it
        elif name in TRANSFERS and self.allow_transfers:
            self._check_transfer(name, args, kwargs)
        else:
            self._check_operands(name, [*args, *kwargs.values()])
        self.ops += 1
        return func(*args, **kwargs)

    def _check_operands(self, name: str, values: list[Any]) -> None:
        for value in values:
            for tensor in value if isinstance(value, list | tuple) else [value]:
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.dim() > 0
                    and tensor.device != self.device
                ):
                    raise AssertionError(
                        f"{name} got a {tensor.device} tensor {tuple(tensor.shape)}: a host "
                        "tensor in device work"
                    )

    def _check_transfer(self, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        if name == "aten._to_copy.default":
            src, target = args[0], kwargs.get("device")
            non_blocking = kwargs.get("non_blocking", False)
        else:  # copy_(dst, src, non_blocking=False)
            src, target = args[1], args[0].device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if src.device != self.device and target == self.device:
            self.transfers += 1
            if not non_blocking:
                raise AssertionError(
                    f"{name}: a blocking host→device copy {tuple(src.shape)} (on CUDA the "
                    "host waits for every queued kernel): pass non_blocking=True"
                )

    def __enter__(self) -> DeviceOnly:
        self._saved_tensor = torch.tensor
        saved, device = torch.tensor, self.device

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            target = kwargs.get("device")
            if target is not None and torch.device(target) == device:
                raise AssertionError(
                    "torch.tensor(data, device=...) copies to the device blocking (a stream "
                    "sync on CUDA): build it on the host, then .to(device, non_blocking=True)"
                )
            return saved(data, *args, **kwargs)

        torch.tensor = tensor  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.tensor = self._saved_tensor  # type: ignore[assignment]
        super().__exit__(*exc)
