"""A ZeRO checkpoint put into a live engine (stagesafe/zero/engine/checkpoint_load.py), on a real 1-rank ZeRO-3
engine in the test process: the host memory the load takes beyond the engine's own state, measured by the
kernel's high-water mark of this process's resident memory (reset just before the load: no sampling, no clock).
The re-partitioning itself at other world sizes is tests/test_world_size.py's.

An engine that already holds its optimizer state (it has stepped) is filled in place: its masters and moments
take the checkpoint's values, bit for bit, in the same tensors, and the load takes next to no host memory
(before, a second copy of the moments: 8 bytes per parameter). Where the engine's partitions are not in host
memory (a GPU; here the CPU engine's partitions are declared so), every byte goes through the bounded staging
buffer (stagesafe/zero/staged_reads.py) and the load's host memory stays within it.
"""

from __future__ import annotations

import ctypes
import pytest
import torch
from test_engine import process_group  # noqa: F401 - a fixture
from torch import nn

from stagesafe.zero import staged_reads
from stagesafe.zero.checkpoint_optimizer import CheckpointOptimizer
from stagesafe.zero.engine import load_rank_files, read_rank_files

pytestmark = pytest.mark.timeout(300)

deepspeed = pytest.importorskip("deepspeed")

WIDTH, DEPTH = 1024, 4  # 4.2 M parameters: 8 bytes each are 34 MB
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


def _high_water_mark() -> int | None:
    """This process's peak resident bytes since the last reset (VmHWM), or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_high_water_mark() -> int:
    """Gives the C heap's free pages back (so that memory freed earlier, still resident, cannot hide a new
    allocation), resets VmHWM to the resident bytes now (Linux: ``5`` into clear_refs) and returns them; skips
    the test where the C library or the kernel does not allow it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError) as error:
        pytest.skip(f"no glibc malloc_trim here: {error}")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as error:
        pytest.skip(f"the peak resident memory cannot be reset here: {error}")
    now = _high_water_mark()
    if now is None:
        pytest.skip("no VmHWM in /proc/self/status")
    return now


def _engine(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(CONFIG))
    x = torch.randn(2, WIDTH).to(engine.device)  # the engine's device: the CPU here, a GPU where DeepSpeed finds one
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return engine


def _flats(engine) -> list[torch.Tensor]:
    """The engine's fp32 master partitions and each one's Adam moments, in order."""
    optimizer = engine.optimizer
    out = []
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        out += [flat, state["exp_avg"], state["exp_avg_sq"]]
    return out


@pytest.fixture(scope="module")
def saved(process_group, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """A checkpoint of plain DeepSpeed and its masters and moments, and an engine that has stepped elsewhere."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    writer = _engine(1)
    writer.save_checkpoint(folder)
    values = [t.clone() for t in _flats(writer)]
    writer.destroy()
    yield folder, values


def _load_measured(engine, folder: str) -> int:
    """Loads ``folder`` into ``engine`` as the strategy does; returns the resident bytes the load added at its
    peak over those before it."""
    before = _reset_high_water_mark()
    files, _ = read_rank_files(engine, folder)
    load_rank_files(engine, files)
    del files
    return _high_water_mark() - before


def test_an_engine_holding_its_state_is_filled_in_place_taking_next_to_no_host_memory(saved, monkeypatch):
    folder, values = saved
    monkeypatch.setattr(staged_reads, "STAGING_BYTES", 2**20)  # on a GPU, where the load stages: 1 MiB of it
    engine = _engine(2)
    try:
        held = _flats(engine)
        assert not torch.equal(held[1], values[1])
        extra = _load_measured(engine, folder)
        after = _flats(engine)
        assert [t.data_ptr() for t in after] == [t.data_ptr() for t in held]  # the same tensors
        for got, want in zip(after, values):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        parameters = sum(p.ds_numel for p in engine.module.parameters())
        assert extra < 2 * parameters, f"the load took {extra / parameters:.1f} bytes per parameter"
    finally:
        engine.destroy()


def test_partitions_outside_host_memory_go_through_the_bounded_staging_buffer(saved, monkeypatch):
    folder, values = saved
    staging = 2**20
    monkeypatch.setattr(staged_reads, "_in_host_memory", lambda out: False)  # as on a GPU
    monkeypatch.setattr(staged_reads, "STAGING_BYTES", staging)
    largest: list[int] = []
    read_all = CheckpointOptimizer.read_all

    def spied(self, reads):
        largest.append(sum(out.numel() * out.element_size() for *_, out in reads))
        return read_all(self, reads)

    monkeypatch.setattr(CheckpointOptimizer, "read_all", spied)
    engine = _engine(3)
    try:
        extra = _load_measured(engine, folder)
        for got, want in zip(_flats(engine), values):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        parameters = sum(p.ds_numel for p in engine.module.parameters())
        assert len(largest) > 12 * parameters // staging and max(largest) <= staging // 2
        assert extra < 2 * parameters, f"the load took {extra / parameters:.1f} bytes per parameter"
    finally:
        engine.destroy()
