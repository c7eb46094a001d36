"""A module whose hyperparameters hold the values users keep there, through checkpoints: one rank of a 2-rank job
(started by run_ranks).

Usage: python hparams_checkpoints.py ROOT
fit (2 steps; ModelCheckpoint writes ROOT/ckpts/last.ckpt during it), trainer.save_checkpoint(ROOT/between.ckpt),
then trainer.test(ckpt_path=...) of each. The module's on_load_checkpoint records the hyperparameters it is
given; rank 0 prints one line ``LOADED <path> <json>`` per test, the json describing each value (its type and
what it holds), and ``EXPECTED <json>``, the same description of the values saved (Enum members and dataclasses
described as stagesafe's stand-ins of them hold them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from toy import ToyModule, dataloader  # noqa: E402

import stagesafe  # noqa: E402


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 0.05
    betas: tuple = (0.9, 0.99)


def hyperparameters(root: str) -> dict:
    return {
        "data_dir": pathlib.Path(root) / "data",
        "scale": np.float64(0.5),
        "seed": np.int64(7),
        "mask": np.arange(4, dtype=np.int32).reshape(2, 2),
        "day": datetime.date(2026, 3, 1),
        "started": datetime.datetime(2026, 3, 1, 12, 30, tzinfo=datetime.timezone.utc),
        "color": Color.BLUE,
        "optimizer": OptimizerConfig(),
        "args": argparse.Namespace(batch_size=4, out=pathlib.PurePosixPath("runs/x")),
        "nested": {"paths": [pathlib.Path("/a"), pathlib.Path("b")], "pair": (np.float32(1.5), Color.RED),
                   "when": {"span": datetime.timedelta(hours=2)}},
    }  # fmt: skip


class HparamsModule(ToyModule):
    def __init__(self, **hparams) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loaded: list = []

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.loaded.append(describe(checkpoint["hyper_parameters"]))


def describe(value):
    """A JSON description of ``value``: its type's name and what it holds; a stand-in (stagesafe's OpaqueRecord)
    as the class it stands for, its arguments and attributes, as a value of that class is described."""
    stands_for = getattr(value, "_stands_for", None)
    if stands_for is not None:
        return {"class": stands_for.rpartition(".")[2], "args": describe(list(value._args)), "attrs": describe(
            dict(value._attributes))}  # fmt: skip
    if isinstance(value, enum.Enum):
        return {"class": type(value).__name__, "args": [value.value], "attrs": {}}
    if dataclasses.is_dataclass(value):
        return {"class": type(value).__name__, "args": [], "attrs": describe(dataclasses.asdict(value))}
    kind = type(value).__name__
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, argparse.Namespace):
        return {"Namespace": describe(vars(value))}
    if isinstance(value, np.ndarray):
        return [kind, str(value.dtype), value.tolist()]
    if isinstance(value, np.generic):
        return [kind, value.item()]
    if isinstance(value, (pathlib.PurePath, datetime.date, datetime.time, datetime.timedelta)):
        return [kind, str(value)]
    return value


def main() -> None:
    root = sys.argv[1]
    rank = int(os.environ["RANK"])
    strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_last=True, every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, callbacks=[checkpoints],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    module = HparamsModule(**hyperparameters(root))
    trainer.fit(module, train_dataloaders=dataloader())
    between = os.path.join(root, "between.ckpt")
    trainer.save_checkpoint(between)
    last = os.path.join(root, "ckpts", "last.ckpt")
    for path in (between, last):
        trainer.test(module, dataloaders=dataloader(), ckpt_path=path, verbose=False)
    if rank == 0:
        print("EXPECTED", json.dumps(describe(hyperparameters(root))), flush=True)
        for path, loaded in zip((between, last), module.loaded):
            print("LOADED", path, json.dumps(loaded), flush=True)


if __name__ == "__main__":
    main()
