"""After a ``fit`` at one rank, ``trainer.optimizers[0].state`` holds what stock's holds (per parameter: ``exp_avg``
and ``exp_avg_sq`` of its shape, ``step``), and those moments are the kept state itself, not a copy: views into the
engine's kept flat partitions. The next fit's engine takes the kept state over and the views go with it; a
``step()`` between calls runs in place and the kept state then belongs to no weights; one that torch cannot run
(16-bit parameters beside fp32 state) is refused before anything changes. One CPU rank, in this process; at two
ranks the state is empty (``tests/test_trainer_attributes.py``), as docs/strategy.md's differences say."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANDOFF = "stagesafe_handoff"


def _run(root, *, stage: int = 3, steps: int = 3, keep: bool = True, precision: str = "32-true",
         configure_model: bool = False, handoff_optimizer_state: bool = False, between_stages: str = "cpu",
         groups: int = 1, callbacks=(), accelerator: str = "cpu", wait: bool = True):
    """A two-layer module (``configure_model``: built there, under zero.Init for ZeRO-3), AdamW with weight decay
    (``groups=2``: the second layer's parameters first, the first's in a group of their own), a Trainer of one
    rank (CPU, or ``accelerator="gpu"``) under stagesafe that waits for its write (``wait``), and its data."""
    import lightning.pytorch as pl
    from torch import nn

    from stagesafe import StageSafeDeepSpeedStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not configure_model:
                self.configure_model()

        def configure_model(self) -> None:
            if not hasattr(self, "second"):
                self.first, self.second = nn.Linear(4, 3), nn.Linear(3, 2)

        def training_step(self, batch, index):
            return self.second(self.first(batch[0])).square().mean()

        def test_step(self, batch, index):
            return self.training_step(batch, index)

        def configure_optimizers(self):
            params = [{"params": self.second.parameters()}, {"params": self.first.parameters(), "lr": 0.02}]
            return torch.optim.AdamW(params if groups == 2 else self.parameters(), lr=0.01, betas=(0.8, 0.9),
                                     weight_decay=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    strategy = StageSafeDeepSpeedStrategy(
        stage=stage, wait_for_write=wait, keep_optimizer_state=keep, handoff_optimizer_state=handoff_optimizer_state,
        between_stages=between_stages,
        handoff_uri=os.path.join(str(root), HANDOFF), overwrite_handoff=True,
        config={"zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
                "train_micro_batch_size_per_gpu": 2})
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=steps, default_root_dir=str(root),
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    return Model(), trainer, data


def _kept_flats(model) -> dict[int, dict]:
    """The kept optimizer file's torch state, by the number its state dict gives each flat partition."""
    from stagesafe.stages.history import history_of

    kept = history_of(model).kept
    assert kept is not None and kept.checkpoint is not None
    (optimizer_file,) = [f for f in kept.checkpoint if f.endswith("optim_states.pt")]
    held = kept.checkpoint[optimizer_file]["optimizer_state_dict"]
    torch_state = held.get("optimizer_state_dict", held.get("base_optimizer_state"))
    return torch_state["state"]


def _storages(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for state in _kept_flats(model).values()
            for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0}


@pytest.mark.parametrize("stage,groups", [(3, 1), (2, 1), (3, 2), (2, 2)])
def test_after_fit_the_optimizer_holds_each_parameters_moments_as_views_into_the_kept_state(in_process, stage, groups):
    import stagesafe
    from stagesafe.handoff.optimizer_state import open_form, state_name

    model, trainer, data = _run(in_process, stage=stage, handoff_optimizer_state=True, groups=groups)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    order = ["second.weight", "second.bias", "first.weight", "first.bias"] if groups == 2 else list(names.values())
    assert [names[id(p)] for g in optimizer.param_groups for p in g["params"]] == order
    uri = os.path.join(str(in_process), HANDOFF)
    form = open_form(uri)
    handed_off = stagesafe.load_state_dict(form.url)  # the same state, gathered per parameter by another path
    kept_storages = _storages(model)
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        for key in ("exp_avg", "exp_avg_sq"):
            tensor = state[key]
            assert tensor.dtype == torch.float32 and tensor.shape == param.shape, (name, key)
            assert torch.equal(tensor.view(torch.int32), handed_off[state_name(key, name)].view(torch.int32))
            assert tensor.untyped_storage().data_ptr() in kept_storages  # the kept memory itself: no copy
        step = state["step"]
        assert isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch.float32
        assert step.item() == 3.0 == form.groups[-1].state["step"]["value"]
    steps = [optimizer.state[p]["step"] for p in model.parameters()]
    assert len({s.data_ptr() for s in steps}) == len(steps)  # a copy per parameter, as torch's AdamW holds it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wait", [False, True])
def test_on_a_gpu_the_state_copied_off_the_device_after_the_call_is_there_at_its_first_use(in_process, wait):
    """On a GPU the kept state comes off the device after the call returned (the writer's device thread): the
    first read of the given-back optimizer's state waits for that copy, then holds the views, as on the CPU."""
    import stagesafe
    from stagesafe.handoff.optimizer_state import open_form, state_name
    from stagesafe.stages.history import history_of

    os.environ.pop("DS_ACCELERATOR", None)  # DeepSpeed's own: the GPU
    model, trainer, data = _run(in_process, accelerator="gpu", handoff_optimizer_state=True, wait=wait)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    states = {name: optimizer.state[param] for name, param in model.named_parameters()}  # may wait for the copy
    assert history_of(model).kept.copied.is_set()
    trainer.strategy.wait_for_handoff()
    handed_off = stagesafe.load_state_dict(open_form(os.path.join(str(in_process), HANDOFF)).url)
    kept_storages = _storages(model)
    for name, state in states.items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and state["step"].item() == 3.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu" and state[key].untyped_storage().data_ptr() in kept_storages
            assert torch.equal(state[key].view(torch.int32), handed_off[state_name(key, name)].view(torch.int32))
    model.training_step(next(iter(data)), 0).backward()  # the module is back on the CPU: a step there works
    optimizer.step()
    assert all(optimizer.state[p]["step"].item() == 4.0 for p in model.parameters())
    assert history_of(model).kept.fingerprint == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_layers_built_in_configure_model_under_bf16_get_fp32_views_and_a_step_is_refused(in_process):
    from stagesafe import InvalidArgumentError
    from stagesafe.stages.history import history_of

    os.environ.pop("DS_ACCELERATOR", None)
    model, trainer, data = _run(in_process, accelerator="gpu", precision="bf16-mixed", configure_model=True,
                                wait=False)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.bfloat16, "cpu")}
    assert {optimizer.state[p]["exp_avg"].dtype for p in model.parameters()} == {torch.float32}  # after the copy
    assert history_of(model).kept.copied.is_set()
    model.training_step(next(iter(data))[0].bfloat16()[None], 0).float().backward()
    with pytest.raises(InvalidArgumentError, match=r"held in torch.bfloat16 .*trainer.fit"):
        optimizer.step()
    trainer.strategy.wait_for_handoff()


def test_the_views_are_where_the_kept_flat_partition_holds_each_parameter(in_process):
    model, trainer, data = _run(in_process)
    trainer.fit(model, data)
    optimizer, flats = trainer.optimizers[0], _kept_flats(model)
    (flat_state,) = flats.values()  # one sub-group: the parameters back to back, in order
    offset = 0
    for param in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            flat = flat_state[key]
            view = optimizer.state[param][key]
            assert view.data_ptr() == flat.data_ptr() + offset * flat.element_size()
            assert torch.equal(view.reshape(-1), flat.narrow(0, offset, param.numel()))
        offset += param.numel()


def test_a_module_of_meta_tensors_between_calls_gets_the_views_too(in_process):
    """between_stages="meta": the module holds no values after the call (new parameter objects on the meta device,
    which the optimizer's groups and state follow), the kept state keeps its fp32 partitions as they are; the views
    look into the kept state all the same, and after a test call too."""
    model, trainer, data = _run(in_process, between_stages="meta")
    trainer.fit(model, data)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    optimizer, kept_storages = trainer.optimizers[0], _storages(model)
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())  # the new objects
    for param in model.parameters():
        assert optimizer.state[param]["exp_avg_sq"].shape == param.shape
        assert optimizer.state[param]["exp_avg_sq"].untyped_storage().data_ptr() in kept_storages
    trainer.test(model, data, verbose=False)  # the module is built from the handoff, then meta tensors again
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    assert all(optimizer.state[p]["step"].item() == 3.0 for p in model.parameters())


def test_the_next_fit_takes_the_kept_state_over_and_the_views_go_as_it_starts(in_process):
    import lightning.pytorch as pl

    seen, given = [], []

    class Look(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.extend(sum(1 for state in optimizer.state.values() if state) for optimizer in given)

    model, trainer, data = _run(in_process, callbacks=[Look()])
    trainer.fit(model, data)
    first = trainer.optimizers[0]
    given.append(first)
    assert sum(1 for state in first.state.values() if state) == 4
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model, data)
    assert seen == [0]  # emptied at the entry, before the new engine's state exists
    assert len(first.state) == 0
    second = trainer.optimizers[0]
    assert second is not first and all(second.state[p]["step"].item() == 3.0 for p in model.parameters())
    assert {second.state[p]["exp_avg"].untyped_storage().data_ptr() for p in model.parameters()} <= _storages(model)


def test_a_step_between_calls_runs_in_place_and_the_kept_state_then_belongs_to_no_weights(in_process):
    from stagesafe.stages.between_calls import kept_training
    from stagesafe.stages.history import history_of, state_tensors

    model, trainer, data = _run(in_process)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
    flats_before = {k: {key: t.clone() for key, t in s.items()} for k, s in _kept_flats(model).items()}
    kept = history_of(model).kept
    assert kept.holds(state_tensors(model))

    model.training_step(next(iter(data)), 0).backward()
    optimizer.step()

    for name, param in model.named_parameters():
        state = optimizer.state[param]
        assert state["exp_avg"] is moments[name]  # in place, in the kept memory
        assert state["step"].item() == 4.0
        assert not torch.equal(param.detach(), before[name])
    (number, flat_state), = _kept_flats(model).items()
    assert not torch.equal(flat_state["exp_avg"], flats_before[number]["exp_avg"])  # the kept flat itself moved
    assert kept.fingerprint == {} and not kept.holds(state_tensors(model))
    assert kept_training(model, world_size=1) == (None, "AdamW.step() (trainer.optimizers) ran on it between Trainer "
                                                        "calls")


def test_a_step_the_user_makes_after_changing_nothing_still_outdates_the_kept_state(in_process):
    """The explicit mark, not only the weights' version: a step that leaves every weight as it was (lr 0, no
    weight decay) still made the moments another state than the one the weights were trained with."""
    from stagesafe.stages.history import history_of

    model, trainer, data = _run(in_process)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    model.training_step(next(iter(data)), 0).backward()
    optimizer.step()
    assert history_of(model).kept.fingerprint == {}


def test_the_next_fit_after_a_users_step_starts_from_the_users_weights(in_process):
    """The user stepped between calls; a fit that makes no step hands off the module's weights as they are now
    (the user's), and the kept state no longer names them."""
    import stagesafe
    from stagesafe.stages.history import history_of

    model, trainer, data = _run(in_process)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    model.training_step(next(iter(data)), 0).backward()
    optimizer.step()
    users = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = None
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, data)  # one more step, from the user's weights
    handoff = stagesafe.load_state_dict(os.path.join(str(in_process), HANDOFF))
    assert all(not torch.equal(handoff[n], users[n]) for n in users)  # trained on
    assert history_of(model).kept.fingerprint != {}
    # the step the fit made started from the user's weights: one AdamW step of lr 0.01 moves each weight by
    # at most about lr (1 + weight decay * |w|)
    assert all((handoff[n] - users[n]).abs().max() < 0.02 for n in users)


def test_a_step_on_16_bit_parameters_beside_fp32_state_is_refused_before_anything_changes(in_process):
    from stagesafe import InvalidArgumentError
    from stagesafe.stages.history import history_of

    model, trainer, data = _run(in_process, precision="bf16-mixed", configure_model=True)
    trainer.fit(model, data)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # held as Lightning built them
    optimizer = trainer.optimizers[0]
    assert {optimizer.state[p]["exp_avg"].dtype for p in model.parameters()} == {torch.float32}
    fingerprint = dict(history_of(model).kept.fingerprint)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.training_step(next(iter(data))[0].bfloat16()[None], 0).float().backward()
    with pytest.raises(InvalidArgumentError, match=r"'first.weight' is held in torch.bfloat16 .*trainer.fit"):
        optimizer.step()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert history_of(model).kept.fingerprint == fingerprint  # still the weights' state
    assert optimizer.state[model.first.weight]["step"].item() == 3.0


def test_without_kept_state_the_optimizers_state_is_empty(in_process):
    model, trainer, data = _run(in_process, keep=False)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    assert not any(optimizer.state.values())


def test_a_checkpoint_saved_between_calls_holds_the_state_the_views_show_and_leaves_them(in_process):
    from stagesafe.zero.checkpoint_optimizer import CheckpointOptimizer
    from stagesafe.zero.checkpoint import open_zero_checkpoint

    model, trainer, data = _run(in_process)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    views = {n: dict(optimizer.state[p]) for n, p in model.named_parameters()}
    path = os.path.join(str(in_process), "between.ckpt")
    trainer.save_checkpoint(path)
    with open_zero_checkpoint(path) as ckpt:
        saved = CheckpointOptimizer(ckpt)
        for name, param in model.named_parameters():
            assert optimizer.state[param]["exp_avg"] is views[name]["exp_avg"]
            for key in ("exp_avg", "exp_avg_sq"):
                value = torch.empty(param.numel())
                saved.read_into(name, key, 0, value)
                assert torch.equal(value.view(torch.int32), views[name][key].reshape(-1).view(torch.int32))
