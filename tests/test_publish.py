"""A stage's weights handed to the writer: a background write reads private copies, made once per tensor, of
what the user could still change; the lone write of rank 0; the handoff's metadata. Real writer and files."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import stagesafe
from _tensors import assert_bitwise_equal
from stagesafe.boundary_report import BoundaryReport
from stagesafe.stages.channel import JobChannel
from stagesafe.stages.history import HandoffTarget, new_history, state_tensors
from stagesafe.stages.ownership import RUN
from stagesafe.stages.publish import HandoffPublisher, handoff_metadata
from stagesafe.stages.stage_end import StageEnd
from stagesafe.stages.writer import HandoffWriter


def _publisher(module: nn.Module, uri: str) -> tuple[HandoffPublisher, HandoffWriter, BoundaryReport]:
    writer = HandoffWriter(JobChannel(dist.HashStore(), rank=0, world=1, prefix="p", timeout=30.0), uri, writers=1,
                           timeout=30.0)
    end = StageEnd(device=None, max_shard_size=10**9, writers=1, training=False, keep_optimizer_state=False,
                   exclude_frozen=False, stage="fit")
    report = BoundaryReport(stage="fit", uri=uri)
    return HandoffPublisher(module, HandoffTarget(uri=uri), writer, end, report), writer, report


def _tied() -> nn.Module:
    module = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False), nn.Linear(3, 1))
    module[1].weight = module[0].weight
    return module


def test_a_background_write_reads_private_copies_of_what_the_user_could_change(tmp_path):
    module, uri = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 1)), str(tmp_path / "h")
    history = new_history(module)
    history.note_names(state_tensors(module))
    master = torch.full((1, 3), 0.5)  # a kept fp32 master: no module tensor, nothing the user can reach
    values = {**state_tensors(module), "1.weight": master}
    expected = {n: v.clone() for n, v in values.items()}
    publisher, writer, report = _publisher(module, uri)
    publisher.start(history, values, state_tensors(module), gathered=None, background=True)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1)  # the user's code, while the write goes on
    writer.join()
    assert_bitwise_equal(stagesafe.load_state_dict(uri), expected)
    assert report.wrote and report.copied_while_waiting == (9 + 1) * 4  # the weight and the bias, not the master
    assert report.handoff_bytes == (9 + 3 + 1) * 4


def test_tied_names_read_one_private_copy_and_stay_tied_in_the_handoff(tmp_path):
    module, uri = _tied(), str(tmp_path / "h")
    history = new_history(module)
    history.note_names(state_tensors(module))
    expected = {n: v.clone() for n, v in state_tensors(module).items()}
    publisher, writer, report = _publisher(module, uri)
    publisher.start(history, state_tensors(module), state_tensors(module), gathered=None, background=True)
    with torch.no_grad():
        module[0].weight.add_(1)  # changes both names: one tensor
    writer.join()
    assert_bitwise_equal(stagesafe.load_state_dict(uri), expected)
    assert stagesafe.read_manifest(uri)["aliases"] == {"1.weight": "0.weight"}
    assert report.copied_while_waiting == (9 + 3 + 1) * 4  # the tied weight once


def test_a_foreground_write_reads_the_values_as_they_are(tmp_path):
    module, uri = _tied(), str(tmp_path / "h")
    history = new_history(module)
    history.note_names(state_tensors(module))
    publisher, writer, report = _publisher(module, uri)
    publisher.start(history, state_tensors(module), state_tensors(module), gathered=None, background=False)
    writer.join()
    assert report.copied_while_waiting == 0 and history.holds(HandoffTarget(uri=uri), state_tensors(module))


def test_rank_zero_writes_alone_now_and_every_rank_forgets_the_handoff_holds_the_weights(tmp_path):
    module, uri = _tied(), str(tmp_path / "h")
    history = new_history(module)
    history.note_names(state_tensors(module))
    history.weights_from = {"stage": "fit", "global_step": 4}
    publisher, writer, report = _publisher(module, uri)
    publisher.alone(history, state_tensors(module))
    assert report.wrote and not writer.pending and history.fingerprint is None
    assert stagesafe.read_manifest(uri)["metadata"] == handoff_metadata(history)
    assert handoff_metadata(history) == {"stage": "fit", "global_step": 4, "original_dtypes": {
        "0.weight": "float32", "1.weight": "float32", "2.weight": "float32", "2.bias": "float32"}, "run": RUN}
