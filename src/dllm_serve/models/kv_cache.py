"""Key/value caches: per-request storage and the batched view one forward reads and writes.

A :class:`KVCache` holds the keys and values of one request's cached prefix for every layer.
Keys are stored *after* RoPE (and after Qwen3's k-norm), so a cached position keeps the rotary
position it was computed at; the caller continues positions from :attr:`KVCache.length`.

Shapes (``Hkv`` = key/value heads, ``hd`` = head dim, ``P`` = cached length):

- storage ``KVCache.keys``/``values``: ``[n_layers, Hkv, P, hd]`` (views of a larger buffer
  that grows by doubling, so appending one block at a time is amortised O(1) per token);
- :class:`KVBatch` read for layer ``l``: ``[B, Hkv, P_max, hd]``, row ``b`` valid in
  ``[0, P_b)`` and zero beyond (zeros, not garbage: masked-out NaNs would still poison SDPA);
- :meth:`KVBatch.prefix_mask`: ``[B, 1, 1, P_max]`` bool, True where a cached key exists.

Cropping never copies: it only shortens the valid length (the prefix cache and I-DLM's KV
trim both drop suffixes, and the freed slots are overwritten by the next append).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformer.py imports this module
    from dllm_serve.models.transformer import DecoderTransformer


class KVCache:
    """Cached keys/values of one request, all layers, positions ``[0, length)``."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 0,
    ) -> None:
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self._length = 0

    @classmethod
    def for_model(cls, model: DecoderTransformer, capacity: int = 0) -> KVCache:
        """An empty cache shaped, typed and placed for ``model``."""
        cfg = model.config
        weight = model.embed_tokens.weight
        return cls(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
            dtype=weight.dtype, device=weight.device, capacity=capacity,
        )  # fmt: skip

    # ---- inspection ----------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._k.shape[2]

    @property
    def keys(self) -> torch.Tensor:
        """``[n_layers, Hkv, length, hd]`` (a view; do not write to it)."""
        return self._k[:, :, : self._length]

    @property
    def values(self) -> torch.Tensor:
        """``[n_layers, Hkv, length, hd]`` (a view; do not write to it)."""
        return self._v[:, :, : self._length]

    @property
    def dtype(self) -> torch.dtype:
        return self._k.dtype

    @property
    def device(self) -> torch.device:
        return self._k.device

    @property
    def nbytes(self) -> int:
        """Bytes held (capacity, not length)."""
        return 2 * self._k.numel() * self._k.element_size()

    # ---- mutation ------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions without changing :attr:`length`."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity, 16)
        n_layers, heads, _, hd = self._k.shape
        k = self._k.new_zeros(n_layers, heads, new_cap, hd)
        v = self._v.new_zeros(n_layers, heads, new_cap, hd)
        k[:, :, : self._length] = self.keys
        v[:, :, : self._length] = self.values
        self._k, self._v = k, v

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``[n_layers, Hkv, T, hd]`` keys and values at positions ``[length, length+T)``."""
        n_layers, heads, _, hd = self._k.shape
        if keys.shape != values.shape or keys.shape[:2] != (n_layers, heads) or keys.shape[3] != hd:
            raise ValueError(
                f"append expects keys/values [{n_layers}, {heads}, T, {hd}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        t = keys.shape[2]
        self.reserve(self._length + t)
        self._k[:, :, self._length : self._length + t] = keys
        self._v[:, :, self._length : self._length + t] = values
        self._length += t

    def crop(self, length: int) -> None:
        """Keep only positions ``[0, length)``."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of length {self._length} to {length}")
        self._length = length

    def drop(self, n: int) -> None:
        """Forget the last ``n`` positions."""
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot drop {n} positions from a cache of length {self._length}")
        self._length -= n

    def clear(self) -> None:
        self._length = 0

    def _write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        # Used by KVBatch during a forward; capacity was reserved when the batch was built.
        t = keys.shape[1]
        self._k[layer, :, start : start + t] = keys
        self._v[layer, :, start : start + t] = values


class KVBatch:
    """One forward's view of several requests' caches (rows may have different lengths).

    ``caches[b]`` is row ``b``'s cache (``None``: no cached prefix, nothing stored). The
    forward's keys are ``[cached prefix of row b (zero-padded to P_max) | current tokens]``;
    the model concatenates :meth:`read` with the current keys and masks padding with
    :meth:`prefix_mask`. ``write[b]`` is how many *leading* current tokens of row ``b`` are
    appended to its cache (0: read only, the "compute with the cache but do not store" case);
    the new length becomes visible only after the whole forward succeeded (:meth:`commit`).
    """

    def __init__(self, caches: Sequence[KVCache | None], write: Sequence[int] | int = 0) -> None:
        self.caches = list(caches)
        if isinstance(write, int):
            write = [write if c is not None else 0 for c in self.caches]
        if len(write) != len(self.caches):
            raise ValueError(f"{len(write)} write counts for {len(self.caches)} rows")
        if any(n and c is None for n, c in zip(write, self.caches, strict=True)):
            raise ValueError("a row without a cache cannot store keys/values")
        self.write_counts = [int(n) for n in write]
        self.prefix_lengths = [c.length if c is not None else 0 for c in self.caches]
        self.max_prefix = max(self.prefix_lengths, default=0)
        self._committed = False
        present = [c for c in self.caches if c is not None]
        if any(c.dtype != present[0].dtype or c.device != present[0].device for c in present):
            raise ValueError("all caches of one batch must share dtype and device")
        self.dtype = present[0].dtype if present else None
        self.device = present[0].device if present else None
        for c, p, n in zip(self.caches, self.prefix_lengths, self.write_counts, strict=True):
            if c is not None and n:
                c.reserve(p + n)

    def __len__(self) -> int:
        return len(self.caches)

    def positions(self, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[B, length]``: each row continues from its cached length (on the caches' device
        unless ``device`` is given)."""
        device = device if device is not None else self.device
        start = torch.tensor(self.prefix_lengths, dtype=torch.long, device=device)
        return start[:, None] + torch.arange(length, device=device)[None]

    def prefix_mask(self) -> torch.Tensor:
        """``[B, 1, 1, P_max]`` bool: True where row ``b`` has a cached key."""
        lengths = torch.tensor(self.prefix_lengths, device=self.device)
        cols = torch.arange(self.max_prefix, device=self.device)
        return (cols[None, :] < lengths[:, None])[:, None, None, :]

    def read(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys/values of ``layer``, ``[B, Hkv, P_max, hd]``, zero-padded per row."""
        b, heads, _, hd = like.shape
        k = like.new_zeros(b, heads, self.max_prefix, hd)
        v = like.new_zeros(b, heads, self.max_prefix, hd)
        for row, (cache, p) in enumerate(zip(self.caches, self.prefix_lengths, strict=True)):
            if cache is not None and p:
                k[row, :, :p] = cache._k[layer, :, :p]
                v[row, :, :p] = cache._v[layer, :, :p]
        return k, v

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the leading ``write[b]`` tokens of ``keys``/``values`` ``[B, Hkv, L, hd]``."""
        if self._committed:
            raise RuntimeError("this KVBatch was already used by a forward; build a new one")
        for row, (cache, p, n) in enumerate(
            zip(self.caches, self.prefix_lengths, self.write_counts, strict=True)
        ):
            if cache is not None and n:
                if n > keys.shape[2]:
                    raise ValueError(f"row {row}: cannot store {n} of {keys.shape[2]} tokens")
                cache._write(layer, p, keys[row, :, :n], values[row, :, :n])

    def commit(self) -> None:
        """Make the stored tokens part of each cache (called once, after the last layer)."""
        if self._committed:
            raise RuntimeError("this KVBatch was already committed")
        self._committed = True
        for cache, p, n in zip(self.caches, self.prefix_lengths, self.write_counts, strict=True):
            if cache is not None and n:
                cache._length = p + n
