"""How the ranks of a tensor-parallel group meet: each rank's device, the standard launcher
environment (``WORLD_SIZE``/``RANK``/``MASTER_*``), joining the ``torch.distributed`` group
(the forward's collectives and a gloo control group), and the check that every rank loads the
same checkpoint with the same world size. What the group then does is ``group.py`` and
``engine/workers.py``.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.hub import resolve_model_path
from dllm_serve.models.sharding import TPShard

# The control channel idles as long as the server has no request; the forward's collectives
# never wait long for a live peer.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
COMPUTE_TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    """A free TCP port on loopback, for a group whose ranks all start on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_for(device: str, rank: int) -> str:
    """One GPU per rank on CUDA (``cuda:LOCAL_RANK`` when a launcher started the ranks, else
    ``cuda:rank``); every rank on ``cpu`` otherwise."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        # Only a launcher's LOCAL_RANK: workers this server spawns inherit its environment, and
        # a LOCAL_RANK left there by a pod spec would put every one of them on the same GPU.
        return f"cuda:{os.environ.get('LOCAL_RANK', rank) if _launched() else rank}"
    return "cpu"


def checkpoint_fingerprint(model: str, sample: int = 1 << 16) -> str:
    """What every rank must agree on: config.json, and each weight file's name, size and
    first and last ``sample`` bytes (its header and some weights: enough to tell two
    checkpoints of one shape apart without reading gigabytes)."""
    path = resolve_model_path(model)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(sample))
            f.seek(max(0, size - sample))
            digest.update(f.read(sample))
    return digest.hexdigest()[:16]


def agree(model: str, size: int, control: Any) -> None:
    """Every rank checks that all ranks load the same checkpoint with the same world size
    (a clear error on every rank, instead of a forward of mismatched shards)."""
    mine = (checkpoint_fingerprint(model), size)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=control)
    wrong = [f"rank {r} {v}" for r, v in enumerate(everyone) if v != everyone[0]]
    if wrong:
        raise ModelLoadError(
            "tensor-parallel ranks disagree on the checkpoint (fingerprint) or the world size: "
            f"rank 0 {everyone[0]}, " + ", ".join(wrong)
        )


def multi_node_rank(size: int) -> int | None:
    """This process's rank when a launcher (torchrun, a Kubernetes indexed Job) set the
    standard ``WORLD_SIZE`` / ``RANK`` environment, else None; the world must be ``size``."""
    if not _launched():
        return None
    world = os.environ["WORLD_SIZE"]
    if int(world) != size:
        raise ModelLoadError(
            f"WORLD_SIZE={world} in the environment but --tensor-parallel-size {size}: every "
            "rank of the group is one process, so they must be equal"
        )
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ModelLoadError(f"WORLD_SIZE={world} is set but {key} is not")
    if not 0 < _env_int("MASTER_PORT") < 65536:  # one line, not torch's traceback
        raise ModelLoadError(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a TCP port")
    rank = _env_int("RANK")
    # A rank outside the group would hang, or die in gloo while rank 0 waits for it.
    if not 0 <= rank < size:
        raise ModelLoadError(f"RANK={rank} in the environment: it must be 0 to {size - 1}")
    return rank


def _launched() -> bool:
    """Whether a launcher started the ranks: ``WORLD_SIZE`` set, and above 1."""
    return "WORLD_SIZE" in os.environ and _env_int("WORLD_SIZE") != 1


def _env_int(key: str) -> int:
    """An integer environment variable of the launcher, or a one-line error naming it."""
    text = os.environ[key]
    try:
        return int(text)
    except ValueError:
        raise ModelLoadError(f"{key}={text!r} in the environment is not an integer") from None


def join(
    rank: int, size: int, init_method: str, device: str, expert_parallel: bool
) -> tuple[TPShard, Any]:
    """Join the group: the shard (collectives on the default group) and the control group."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COMPUTE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPShard(rank, size, group=None, expert_parallel=expert_parallel), control
