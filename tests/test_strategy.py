"""StageSafeDeepSpeedStrategy's own arguments: every one is checked when the strategy is made, before any
process starts, and the user's config dict is never kept."""

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
    ],
)
def test_bad_values_are_refused_when_the_strategy_is_made(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        StageSafeDeepSpeedStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [({"wait_for_write": "yes"}, "wait_for_write must be True or False"), ({"storage_options": ["key"]}, "must be a dict")],
)
def test_bad_types_are_refused_when_the_strategy_is_made(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        StageSafeDeepSpeedStrategy(**kwargs)


def test_good_arguments_are_kept():
    strategy = StageSafeDeepSpeedStrategy(stage=3, between_stages="meta", max_shard_size="2GiB", wait_for_write=True)
    assert (strategy.between_stages, strategy.max_shard_size, strategy.wait_for_write) == ("meta", "2GiB", True)


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


def test_the_comm_op_build_is_announced_with_its_folder_when_it_is_not_built(tmp_path, monkeypatch, caplog):
    import logging

    from stagesafe.cpu_strategy import announce_comm_op_build, comm_op_folder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert comm_op_folder() == str(tmp_path / "deepspeed_shm_comm")
    with caplog.at_level(logging.INFO):
        announce_comm_op_build()
    assert f"building its CPU comm op in {tmp_path / 'deepspeed_shm_comm'}" in caplog.text
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        announce_comm_op_build()
    assert "building" not in caplog.text  # built: nothing to say
