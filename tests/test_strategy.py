"""StageSafeDeepSpeedStrategy's own logic, in this process: its arguments (every one is checked when the strategy
is made, before any process starts, and the user's config dict is never kept), the inference engine's config, and
what a Trainer call leaves behind (the boundary's report, the released engine) on one CPU rank."""

from __future__ import annotations

import pytest

from stagesafe import InvalidArgumentError, StageSafeDeepSpeedStrategy, StorageBackendError


def test_the_users_config_dict_is_copied_not_kept():
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    strategy = StageSafeDeepSpeedStrategy(config=config)
    strategy.config["zero_optimization"]["stage"] = 2
    assert config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("name", ["handoff_uri", "resume_from"])
def test_urls_must_be_strings_of_a_known_protocol(name):
    with pytest.raises(TypeError, match=f"{name} must be a str"):
        StageSafeDeepSpeedStrategy(**{name: 42})
    with pytest.raises(StorageBackendError, match="no filesystem is known for protocol 'nosuch'"):
        StageSafeDeepSpeedStrategy(**{name: "nosuch://bucket/run"})


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_shard_size": "5XB"}, "max_shard_size='5XB' is not a size"),
        ({"max_shard_size": 0}, "max_shard_size=0 is not a size"),
        ({"between_stages": "gpu"}, "choose 'cpu'"),
        ({"stage": 2, "between_stages": "meta"}, "needs ZeRO stage 3"),
        ({"stage": 3, "between_stages": "meta", "handoff_optimizer_state": True},
         r"handoff_optimizer_state=True with between_stages='meta'.*use between_stages='cpu'"),
    ],
)
def test_bad_values_are_refused_when_the_strategy_is_made(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        StageSafeDeepSpeedStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [({"storage_options": ["key"]}, "must be a dict")],
)
def test_bad_types_are_refused_when_the_strategy_is_made(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        StageSafeDeepSpeedStrategy(**kwargs)


def test_good_arguments_are_kept():
    strategy = StageSafeDeepSpeedStrategy(stage=3, between_stages="meta", max_shard_size="2GiB", wait_for_write=True)
    assert (strategy.between_stages, strategy.max_shard_size, strategy.wait_for_write) == ("meta", "2GiB", True)


def test_a_positional_argument_that_would_land_in_the_wrong_place_is_refused():
    """``StageSafeDeepSpeedStrategy(3)`` made 3 Lightning's ``accelerator`` and left the stage at 2."""
    with pytest.raises(TypeError, match=r"got 1 positional: they would land in DeepSpeedStrategy's accelerator=3; "
                                        r"for ZeRO stage 3 pass stage=3"):
        StageSafeDeepSpeedStrategy(3)
    with pytest.raises(TypeError, match=r"accelerator=None, zero_optimization=True, stage=3\. Pass each argument"):
        StageSafeDeepSpeedStrategy(None, True, 3)
    from lightning.pytorch.accelerators import CPUAccelerator

    accelerator = CPUAccelerator()
    assert StageSafeDeepSpeedStrategy(accelerator, stage=3).accelerator is accelerator  # where Lightning's takes it


@pytest.mark.parametrize("stage", [4, -1, True, "3", 2.0])
def test_a_stage_outside_0_to_3_is_refused(stage):
    with pytest.raises(InvalidArgumentError, match=r"stage=.* is not a ZeRO stage: pass 0, 1, 2 \(the default\) or 3"):
        StageSafeDeepSpeedStrategy(stage=stage)


def test_a_config_whose_stage_is_outside_0_to_3_is_refused():
    config = {"zero_optimization": {"stage": 5}, "train_micro_batch_size_per_gpu": 1}
    with pytest.raises(InvalidArgumentError, match=r"config\['zero_optimization'\]\['stage'\]=5 is not a ZeRO stage"):
        StageSafeDeepSpeedStrategy(config=config)
    assert StageSafeDeepSpeedStrategy(stage=0).config["zero_optimization"]["stage"] == 0


def test_the_cpu_without_ds_accelerator_gets_lightnings_refusal_then_the_hint(monkeypatch):
    from lightning.pytorch.accelerators import CPUAccelerator

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    strategy = StageSafeDeepSpeedStrategy(accelerator=CPUAccelerator(), stage=3)
    with pytest.raises(RuntimeError) as caught:
        strategy.setup_environment()
    message = str(caught.value)
    assert "`CPUAccelerator` is used. To run DeepSpeed on CPU processes (gloo)" in message, message
    assert message.endswith("before starting the script.") and ".;" not in message


def test_a_misspelt_argument_names_this_class_and_the_argument_meant():
    with pytest.raises(TypeError, match=r"StageSafeDeepSpeedStrategy\(\) got an unexpected keyword argument 'handof_uri'; "
                                        r"did you mean 'handoff_uri'\?"):
        StageSafeDeepSpeedStrategy(handof_uri="h")
    with pytest.raises(TypeError, match="did you mean 'offload_optimizer'"):  # Lightning's own arguments too
        StageSafeDeepSpeedStrategy(offload_optimiser=True)


def test_a_local_resume_from_that_is_not_a_handoff_fails_when_the_strategy_is_made(tmp_path):
    from stagesafe.errors import HandoffNotFoundError

    with pytest.raises(HandoffNotFoundError, match="there is no such folder"):
        StageSafeDeepSpeedStrategy(resume_from=str(tmp_path / "no-such-run"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HandoffNotFoundError, match="holds no committed handoff"):
        StageSafeDeepSpeedStrategy(resume_from=str(tmp_path / "empty"))


FLAGS = ["wait_for_write", "keep_optimizer_state", "check_host_memory", "exclude_frozen_parameters",
         "handoff_optimizer_state"]


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_the_strategy_flags_must_be_true_or_false(name, value):
    with pytest.raises(InvalidArgumentError, match=f"{name}={value!r} must be True or False"):
        StageSafeDeepSpeedStrategy(**{name: value})
    assert getattr(StageSafeDeepSpeedStrategy(**{name: False}), name) is False


def test_a_misspelt_argument_close_to_nothing_gets_no_guess():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        StageSafeDeepSpeedStrategy(zzz=1)


def test_paths_are_kept_as_str_urls(tmp_path):
    strategy = StageSafeDeepSpeedStrategy(handoff_uri=tmp_path / "handoff")
    assert strategy.handoff_uri == str(tmp_path / "handoff") and strategy.resume_from is None


def test_a_resume_from_off_the_local_disk_is_read_at_the_first_stage_not_when_the_strategy_is_made(tmp_path):
    import stagesafe

    assert StageSafeDeepSpeedStrategy(resume_from="memory://nothing/here").resume_from == "memory://nothing/here"
    stagesafe.save_state_dict({"w": __import__("torch").ones(2)}, str(tmp_path / "earlier"))
    assert StageSafeDeepSpeedStrategy(resume_from=str(tmp_path / "earlier")).resume_from == str(tmp_path / "earlier")


def test_before_its_first_call_a_strategy_has_no_report_and_no_engine_to_release():
    strategy = StageSafeDeepSpeedStrategy()
    assert strategy.last_boundary is None
    assert strategy.deepspeed_engine is None  # no call has built one yet: nothing was released


def test_an_inference_engine_takes_the_precision_and_the_zero3_partitioning_and_no_optimizer():
    from stagesafe.strategy_arguments import inference_config as _inference_config

    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam"}, "train_micro_batch_size_per_gpu": 8}
    inference = _inference_config(config, zero_stage_3=True)
    assert inference == {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                         "zero_allow_untested_optimizer": True, "zero_optimization": config["zero_optimization"]}
    assert inference["zero_optimization"] is not config["zero_optimization"]  # copies DeepSpeed may write into
    assert inference["bf16"] is not config["bf16"]
    assert _inference_config({**config, "zero_allow_untested_optimizer": False}, zero_stage_3=True)[
        "zero_allow_untested_optimizer"] is False
    assert _inference_config({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, zero_stage_3=False) == {
        "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}


# -- one Trainer, one rank, in this process --------------------------------------------------------------------------
def _one_rank_run(root, optimizer: str = "SGD", *, configure_model: bool = False):
    """A one-layer LightningModule (training and test steps; ``configure_model``: a second layer built there,
    under zero.Init), a Trainer of one CPU rank under stagesafe with a foreground write, and data: what the
    in-process tests run."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def configure_model(self) -> None:
            if configure_model and not hasattr(self, "built"):
                self.built = nn.Linear(2, 2)

        def training_step(self, batch, index):
            out = self.layer(batch[0])
            return (self.built(out) if hasattr(self, "built") else out).sum()

        def test_step(self, batch, index):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return getattr(torch.optim, optimizer)(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    strategy = StageSafeDeepSpeedStrategy(stage=3, wait_for_write=True, config={
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2})
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, default_root_dir=root,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    return Model(), strategy, trainer, data


@pytest.mark.slow
def test_after_a_call_the_report_says_what_its_boundary_did_and_the_engine_is_released(in_process):
    import stagesafe
    from stagesafe import EngineReleasedError
    from _tensors import assert_bitwise_equal

    model, strategy, trainer, data = _one_rank_run(in_process)
    trainer.fit(model, data)
    report, uri = strategy.last_boundary, str(in_process / "stagesafe_handoff")
    assert (report.stage, report.uri, report.wrote, report.clean) == ("fit", uri, True, True)
    assert {"consolidate", "destroy", "publish", "handoff_write"} <= set(report.phases)
    assert_bitwise_equal(stagesafe.load_state_dict(uri), {n: t.detach() for n, t in model.state_dict().items()})
    with pytest.raises(EngineReleasedError, match=f"the handoff at '{uri}'"):
        strategy.deepspeed_engine
    with pytest.warns(UserWarning, match="this Trainer has already trained to max_steps=1: fit will return without"):
        trainer.fit(model, data)  # the same Trainer, already at max_steps
    assert strategy.last_boundary is not report and strategy.last_boundary.stage == "fit"


@pytest.mark.slow
def test_once_the_user_lets_go_a_module_its_trainer_and_its_kept_state_are_freed(in_process):
    import gc
    import weakref

    from stagesafe.stages.history import history_of

    freed = []
    for _ in range(2):  # a sweep: one module after another in one process
        model, strategy, trainer, data = _one_rank_run(in_process, optimizer="AdamW")
        trainer.fit(model, data)
        trainer.test(model, data, verbose=False)
        kept = history_of(model).kept
        assert kept is not None and kept.checkpoint is not None  # the optimizer state it keeps between calls
        freed += [weakref.ref(model), weakref.ref(trainer), weakref.ref(strategy), weakref.ref(kept)]
        del model, trainer, strategy, kept
        gc.collect()
    assert [ref() for ref in freed] == [None] * len(freed)  # DeepSpeed's globals held every one


@pytest.mark.slow
def test_a_fit_whose_host_memory_could_not_be_made_ready_still_ends_with_its_weights(in_process, monkeypatch, caplog):
    import torch

    import stagesafe
    from stagesafe.stages import page_lock
    from _tensors import assert_bitwise_equal

    def no_mapping(shape, dtype):
        raise MemoryError("could not map host memory: Cannot allocate memory")

    monkeypatch.setattr(page_lock, "empty", no_mapping)  # e.g. vm.max_map_count reached
    model, strategy, trainer, data = _one_rank_run(in_process, configure_model=True)  # its layer needs new memory
    with caplog.at_level("WARNING", logger="stagesafe"):
        trainer.fit(model, data)
    assert "preparing host memory for the end of the stage failed" in caplog.text
    handoff = stagesafe.load_state_dict(str(in_process / "stagesafe_handoff"))
    assert_bitwise_equal(handoff, {n: t.detach() for n, t in model.state_dict().items()})
    assert model.layer.weight.dtype == torch.float32 and model.layer.weight.numel() == 8
    assert model.built.weight.numel() == 4 and sorted(handoff) == ["built.bias", "built.weight", "layer.bias",
                                                                     "layer.weight"]
