"""The parallel path's pieces that fit one GPU (run with ``-m gpu``): a one-rank NCCL group
initialises and gathers, and the vocab-parallel sampler's per-rank reduction on CUDA (a CUDA
generator's state carried to the other ranks) gives the proposals of the whole logits."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dllm_serve.decoding.sampler import gumbel_argmax
from dllm_serve.engine.parallel.group import VocabTraffic
from dllm_serve.engine.parallel.vocab import VocabOp, VocabShardedLogits, apply, combine_statistics
from dllm_serve.models.sharding import TPShard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_one_rank_nccl_group_runs_the_samplers_gather() -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        logits = torch.randn(2, 4, 64, device="cuda")
        sharded = VocabShardedLogits(logits, TPShard(0, 1), None, traffic=VocabTraffic())
        masked = logits.clone()
        masked[..., 5] = float("-inf")
        assert torch.equal(sharded.greedy(5), masked.argmax(-1))
        assert torch.equal(sharded.dense([1]), logits[1:2])
        assert sharded.traffic.collectives == 2
    finally:
        dist.destroy_process_group()


def test_per_rank_reductions_on_cuda_equal_the_whole_vocabulary() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(2, 6, 96, device="cuda", generator=g)
    mask_id, size, temperature = 7, 4, 0.8
    dense = logits.clone()
    dense[..., mask_id] = float("-inf")
    want_gen = torch.Generator(device="cuda").manual_seed(11)
    live = torch.Generator(device="cuda").manual_seed(11)
    op = VocabOp("propose", None, mask_id, ((0, 5, temperature, live.get_state()),))
    parts = [apply(op, logits.chunk(size, -1)[0], TPShard(0, size), {0: live})]
    parts += [apply(op, logits.chunk(size, -1)[r], TPShard(r, size)) for r in range(1, size)]
    tokens, top1, _inverse = combine_statistics(torch.stack(parts))
    assert torch.equal(tokens[0, :5], gumbel_argmax(dense[0, :5], temperature, want_gen))
    assert torch.equal(tokens[1], dense[1].argmax(-1))
    assert torch.equal(live.get_state(), want_gen.get_state())
    p = torch.softmax(dense[1].double(), -1).gather(-1, tokens[1][:, None]).squeeze(-1)
    torch.testing.assert_close(top1[1], p, rtol=1e-5, atol=0)
