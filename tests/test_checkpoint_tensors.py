"""zero/checkpoint_tensors.py: a ZeRO checkpoint's tensors as described from its rank files; pure pieces tested
with plain data (a tensor's size, the client entries of a model-states dict)."""

from __future__ import annotations

from stagesafe.zero.checkpoint_tensors import TensorSpec, client_entries


def test_a_specs_size_is_its_elements_times_its_dtypes_bytes():
    spec = TensorSpec(name="w", kind="param", dtype="bfloat16", shape=(3, 4))
    assert spec.numel == 12 and spec.nbytes == 24
    assert TensorSpec(name="b", kind="buffer", dtype="float32", shape=()).numel == 1


def test_the_client_entries_are_those_deepspeed_did_not_write():
    states = {"module": {}, "optimizer": None, "global_steps": 3, "epoch": 2, "loops": {"fit": 1}}
    assert client_entries(states) == {"epoch": 2, "loops": {"fit": 1}}
