"""A live engine's fp32 masters read out of it and written into it (stagesafe/zero/engine/values_out.py,
values_in.py) on a real ZeRO-3 engine of two gloo ranks, where the batched copies meet every kind of partition:
many small parameters that the two ranks divide evenly (one batched copy), sizes that leave padding in rank 1's
partition or make it all padding (one at a time), a frozen and a tied parameter, values in another dtype.
Compared bit for bit with what DeepSpeed's own ``safe_get_full_fp32_param`` gives."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import two_ranks  # noqa: F401 - a fixture
from torch import nn

pytestmark = pytest.mark.timeout(300)

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
SIZES = [16] * 40 + [15, 3, 1, 7, 2, 33, 64]  # even; rank 1 padded (15, 3, 7, 33); rank 1 all padding (1)


class _Many(nn.Module):
    """Many small parameters of ``SIZES``, a frozen one, and a tied pair."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ParameterList(nn.Parameter(torch.randn(n) * 0.1) for n in SIZES)
        self.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
        self.shared = nn.Linear(4, 4, bias=False)
        self.tied = nn.Linear(4, 4, bias=False)
        self.tied.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = sum(p.sum() for p in self.small) + self.frozen.sum()
        return self.tied(self.shared(x)).sum() * total


def _engine():
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None  # DeepSpeed's copy of the last test's process group, which these ranks left
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # what a launcher sets, and DeepSpeed asks for
    torch.manual_seed(0)
    model = _Many()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(CONFIG), dist_init_required=False)
    for _ in range(2):  # the masters move away from the module's first values
        engine.backward(engine(torch.randn(1, 4)).pow(2))
        engine.step()
    return engine, model


def _deepspeeds_masters(model: nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    return {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor).view(torch.uint8)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype and torch.equal(_bytes(a[n]), _bytes(b[n])) for n in a)


def _gather_into_host_tensors() -> dict:
    """Masters gathered a bucket per collective into host tensors given (one of the wrong dtype: not placed), half
    of them kept for a private copy."""
    from stagesafe.zero import engine as zero_engine

    engine, model = _engine()
    expected = _deepspeeds_masters(model)
    names = list(expected)
    into = {n: torch.full_like(t, -1.0) for n, t in expected.items()}
    into["small.0"] = torch.empty(16, dtype=torch.bfloat16)  # does not fit: the master goes to memory of its own
    mine = set(names[::2])
    gathered = zero_engine.GatheredValues(model, lambda name, tensor: tensor, into=into, keep_for=mine)
    gathered.gather_masters(names)
    values = {n: gathered[n] for n in names}
    gathered.synchronize()
    copies = gathered.private_copies({})
    result = {
        "values": _equal(values, expected),
        "placed": sorted(n for n in names if values[n] is into[n]),
        "copies": _equal(copies, {n: expected[n] for n in copies}) and copies.keys() == mine - {"small.0"},
        "private": not {c.data_ptr() for c in copies.values()} & {t.data_ptr() for t in into.values()},
        "names": names,
        "buffers": len({c.untyped_storage().data_ptr() for n, c in copies.items() if n.startswith("small.")}),
    }
    engine.destroy()
    return result


@pytest.mark.slow
def test_masters_of_many_small_odd_and_tied_parameters_are_gathered_into_host_tensors_bitwise(two_ranks):
    for seen in two_ranks.run(_gather_into_host_tensors):
        assert not isinstance(seen, BaseException), seen
        assert seen["values"] and seen["copies"] and seen["private"], seen
        assert seen["placed"] == sorted(n for n in seen["names"] if n != "small.0")  # every one that fits
        assert "frozen" not in seen["names"] and "tied.weight" not in seen["names"]  # no master; tied: once
        # the private copies of partitions without padding share one buffer (one batched copy); the padded ones
        # (15 and 1 elements, of the kept) come one at a time, each in memory of its own
        assert seen["buffers"] == 1 + 2, seen


def _set_masters() -> dict:
    """New values (some in bf16, converted as DeepSpeed's own set does) become the masters, bit for bit, and rank
    1's padding stays zero."""
    from stagesafe.zero import engine as zero_engine

    engine, model = _engine()
    torch.manual_seed(1)
    new = {n: torch.randn(p.ds_shape) for n, p in model.named_parameters(remove_duplicate=False)}
    new["tied.weight"] = new["shared.weight"]
    for name in ("small.1", "small.41", "small.42"):  # even, padded, all padding on rank 1
        new[name] = new[name].bfloat16()
    count = zero_engine.set_fp32_masters(model, new)
    got = _deepspeeds_masters(model)
    expected = {n: new[n].float() for n in got}
    optimizer = engine.optimizer
    partitions = {n: optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0].clone()
                  for n, p in model.named_parameters() if p.requires_grad}
    rank = torch.distributed.get_rank()
    tails = {n: part[max(0, expected[n].numel() - rank * part.numel()):].tolist() for n, part in partitions.items()}
    engine.destroy()
    return {"count": count, "equal": _equal(got, expected), "padding": {n: t for n, t in tails.items() if t}}


@pytest.mark.slow
def test_set_fp32_masters_of_many_small_odd_and_tied_parameters_is_bitwise_and_zeroes_the_padding(two_ranks):
    rank0, rank1 = two_ranks.run(_set_masters)
    for seen in (rank0, rank1):
        assert not isinstance(seen, BaseException), seen
        assert seen["equal"], seen
        assert seen["count"] == len(SIZES) + 1  # the small ones and the tied pair once; the frozen one has none
    assert rank0["padding"] == {}
    padded = {"small.40": [0.0], "small.41": [0.0], "small.42": [0.0], "small.43": [0.0], "small.45": [0.0]}
    assert rank1["padding"] == padded


def _partitions_built(flat: bool, bf16: bool) -> dict[str, torch.Tensor]:
    """Each parameter's 16-bit (or fp32) partition and fp32 master partition on this rank, of an engine built over a
    module whose values differ between the ranks (every rank must end with rank 0's)."""
    import contextlib

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from stagesafe.zero import engine as zero_engine

    groups._WORLD_GROUP = None
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    torch.manual_seed(dist.get_rank())  # the ranks' modules differ
    model = _Many()
    config = {**CONFIG, "bf16": {"enabled": bf16}}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with zero_engine.flat_broadcasts() if flat else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    def valid(p: nn.Parameter, partition: torch.Tensor) -> torch.Tensor:  # DeepSpeed leaves padding uninitialized
        return partition[: max(0, min(partition.numel(), p.ds_numel - dist.get_rank() * partition.numel()))].clone()

    built = {f"{n}/partition": valid(p, p.ds_tensor.detach()) for n, p in model.named_parameters()}
    optimizer = engine.optimizer
    built.update({f"{n}/master": valid(p, optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0])
                  for n, p in model.named_parameters() if p.requires_grad})
    engine.destroy()
    return built


def _built_both_ways(bf16: bool) -> dict:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    own = (DeepSpeedEngine._broadcast_model, Init._convert_to_zero_parameters)
    theirs, ours = _partitions_built(False, bf16), _partitions_built(True, bf16)
    return {"equal": _equal(ours, theirs), "count": len(ours),
            "restored": own == (DeepSpeedEngine._broadcast_model, Init._convert_to_zero_parameters)}


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_an_engine_built_with_a_broadcast_per_bucket_holds_deepspeeds_own_partitions_bitwise(two_ranks, bf16):
    for seen in two_ranks.run(_built_both_ways, bf16):
        assert not isinstance(seen, BaseException), seen
        assert seen["equal"] and seen["restored"], seen
        assert seen["count"] == 2 * (len(SIZES) + 1) + 1  # partitions of every parameter, masters of the trained
