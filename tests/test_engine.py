"""A live DeepSpeed engine's internals (stagesafe/zero/engine/), on a real 1-rank ZeRO-3 engine built in the test
process (gloo; on the CPU, or on the GPU where DeepSpeed chose it before these tests began): the state it leaves
on a module and what takes it away, the full shapes behind its placeholders, the weights read out of it and
loaded into it, and its checkpoint files. Tensors compare bit for bit.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
from _launch import end_process_group, free_port
from _tensors import assert_bitwise_equal
from torch import nn

from stagesafe.zero import engine as zero_engine

pytestmark = pytest.mark.timeout(300)  # the first engine may build DeepSpeed's CPU comm op (about 30 s, once)

deepspeed = pytest.importorskip("deepspeed")

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}
TRAINED = ["embed.weight", "hidden.weight", "hidden.bias", "proj.weight", "proj.bias"]  # once each: head.weight is tied


class Net(nn.Module):
    """Trained, frozen and tied parameters and a buffer; fp32, so the fp32 masters equal the weights exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.hidden = nn.Linear(4, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.proj = nn.Linear(5, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.frozen(self.hidden(self.embed(x)).relu()))) * self.scale


@pytest.fixture(scope="module")
def process_group():
    """One gloo rank for the module's tests, its rendezvous variables and process group gone afterwards."""
    assert not torch.distributed.is_initialized(), "a process group of another test is still there"
    patch = pytest.MonkeyPatch()
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        patch.setenv(name, value)
    patch.setenv("MASTER_PORT", str(free_port()))
    patch.setenv("DS_ACCELERATOR", "cpu")
    deepspeed.init_distributed("gloo", verbose=False)
    yield
    end_process_group()
    patch.undo()


@pytest.fixture
def build(process_group):
    """``build(model, optimizer=True)``: a ZeRO-3 engine of ``model``, destroyed when the test ends."""
    engines = []

    def make(model: nn.Module, *, optimizer: bool = True):
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=0.1) if optimizer else None
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=dict(CONFIG))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict name (tied ones too) -> a copy of its tensor, sorted by name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {**{n: p.detach().clone() for n, p in params.items()}, **{n: b.clone() for n, b in model.named_buffers()}}
    return dict(sorted(state.items()))


def _step(engine) -> None:
    loss = engine(torch.tensor([[1, 2, 3], [4, 5, 6]], device=engine.device)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _ds_attributes(model: nn.Module) -> list[str]:
    objects = [*model.named_modules(), *model.named_parameters()]
    return [f"{name}.{key}" for name, obj in objects for key in vars(obj) if key.startswith("ds_")]


def _hook_ids(model: nn.Module) -> dict[str, dict[str, list[int]]]:
    tables = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return {name: {t: list(getattr(sub, t)) for t in tables} for name, sub in model.named_modules()}


def _user_hook(module, args, output):
    return output


# -- the state an engine leaves on a module --------------------------------------------------------------------------


def test_a_footprint_lets_strip_take_away_all_an_engine_added_and_keep_the_users_hooks_and_attributes(build):
    model = _net()
    model.hidden.register_forward_hook(_user_hook)
    model.hidden.note = "the user's"
    model.hidden.weight.note = "the user's too"
    hooks, types = _hook_ids(model), {name: type(sub._parameters) for name, sub in model.named_modules()}
    assert zero_engine.find_stale_state(model) == [] and _ds_attributes(model) == []
    footprint = zero_engine.take_footprint(model)

    engine = build(model)
    assert zero_engine.is_engine(engine) and not zero_engine.is_engine(model) and not zero_engine.is_engine(None)
    assert "hidden.weight.ds_id" in _ds_attributes(model) and "hidden.ds_id" in _ds_attributes(model)
    assert type(model.hidden._parameters).__name__ == "ZeROOrderedDict"
    assert _hook_ids(model) != hooks
    assert model.hidden.weight.numel() == 0  # a ZeRO-3 placeholder
    stale = zero_engine.find_stale_state(model)
    assert any("'hidden' carries DeepSpeed attributes" in s for s in stale), stale
    assert any("DeepSpeed hook(s) in _forward_pre_hooks" in s for s in stale), stale
    assert any("parameter 'hidden.weight' is an empty ZeRO-3 placeholder" in s for s in stale), stale

    zero_engine.destroy_engine(engine)
    zero_engine.strip_deepspeed_state(model, footprint)
    assert _ds_attributes(model) == []
    assert {name: type(sub._parameters) for name, sub in model.named_modules()} == types
    assert _hook_ids(model) == hooks  # the user's hook, and only it
    assert model.hidden._forward_hooks[next(iter(model.hidden._forward_hooks))] is _user_hook
    assert model.hidden.note == "the user's" and model.hidden.weight.note == "the user's too"
    assert [s for s in zero_engine.find_stale_state(model) if "placeholder" not in s] == []  # values: not its job


def test_without_a_footprint_strip_takes_away_only_what_is_deepspeeds(build):
    model = _net()
    engine = build(model)
    model.hidden.register_forward_hook(_user_hook)  # after the engine: no footprint could know it
    model.hidden.note = "the user's"
    zero_engine.destroy_engine(engine)
    zero_engine.strip_deepspeed_state(model, None)
    assert _ds_attributes(model) == []
    assert type(model.hidden._parameters) is dict
    assert list(model.hidden._forward_hooks.values()) == [_user_hook]
    assert model.hidden.note == "the user's"
    assert not any("hook" in s or "attributes" in s for s in zero_engine.find_stale_state(model))


def test_fresh_parameters_are_not_stale_and_lose_what_deepspeed_put_on_them(build):
    """Parameters zero.Init built in this call (Lightning's configure_model) carry DeepSpeed's attributes by design:
    not stale, and a footprint taken then does not keep what DeepSpeed put on them."""
    model = _net()
    engine = build(model)
    fresh = [id(p) for p in model.parameters()]
    assert any(s.startswith("parameter ") for s in zero_engine.find_stale_state(model))
    assert not any(s.startswith("parameter ") for s in zero_engine.find_stale_state(model, fresh=fresh))
    assert any(s.startswith("module ") for s in zero_engine.find_stale_state(model, fresh=fresh))
    added = "all_gather"  # a method DeepSpeed binds on each parameter, not named ds_*
    assert added in vars(model.hidden.weight)
    kept_as_is = zero_engine.take_footprint(model)
    as_fresh = zero_engine.take_footprint(model, fresh=fresh)
    assert added in kept_as_is.param_attrs[id(model.hidden.weight)]
    assert as_fresh.param_attrs[id(model.hidden.weight)] == set()
    zero_engine.destroy_engine(engine)
    zero_engine.strip_deepspeed_state(model, as_fresh)
    assert added not in vars(model.hidden.weight) and _ds_attributes(model) == []


# -- reading and writing the weights of a live engine ----------------------------------------------------------------


def test_full_specs_are_the_shapes_and_dtypes_behind_the_placeholders_and_name_the_tied_parameter(build):
    model = _net()
    expected = {name: (t.shape, t.dtype) for name, t in _state(model).items()}
    build(model)
    assert model.embed.weight.shape == (0,)
    specs, aliases = zero_engine.full_specs(model)
    assert dict(sorted(specs.items())) == expected
    assert aliases == {"head.weight": "embed.weight"}


def test_gathered_values_are_the_weights_bitwise_and_only_trained_parameters_have_masters(build):
    model = _net()
    expected = _state(model)
    build(model)
    params = dict(model.named_parameters())
    assert [n for n, p in params.items() if zero_engine.has_fp32_master(p)] == TRAINED
    gathered = zero_engine.GatheredValues(model, lambda name, tensor: tensor)
    assert sorted(gathered) == list(expected) and len(gathered) == len(expected)
    assert_bitwise_equal(dict(sorted((name, gathered[name]) for name in gathered)), expected)


def test_masters_gathered_in_buckets_go_into_the_host_tensors_given_and_a_private_copy(build):
    model = _net()
    expected = _state(model)
    engine = build(model)
    into = {name: torch.empty_like(expected[name]) for name in TRAINED}
    private_into = {name: torch.empty_like(expected[name]) for name in TRAINED}
    mine = set(TRAINED[:3])  # the shards this rank writes
    gathered = zero_engine.GatheredValues(model, lambda name, tensor: tensor, into=into, keep_for=mine)
    gathered.gather_masters(TRAINED)
    values = {name: gathered[name] for name in sorted(gathered)}
    gathered.synchronize()
    assert all(values[name] is into[name] for name in TRAINED)
    assert_bitwise_equal(values, expected)
    copies = gathered.private_copies(private_into)
    assert copies.keys() == mine and gathered.kept == {}
    assert_bitwise_equal(dict(sorted(copies.items())), {n: expected[n] for n in sorted(mine)})
    assert not {c.data_ptr() for c in copies.values()} & {t.data_ptr() for t in [*into.values(), *values.values()]}
    if engine.device.type == "cuda":  # copied into the host memory given
        assert all(copies[n].data_ptr() == private_into[n].data_ptr() for n in mine)
    else:  # on the CPU the gathered masters are copies of their own already: no second one
        assert not any(copies[n].data_ptr() == private_into[n].data_ptr() for n in mine)


def _other_values() -> dict[str, torch.Tensor]:
    """Values for every state-dict name of :class:`Net` other than its own; the tied names share one tensor."""
    torch.manual_seed(1)
    values = {name: torch.randn_like(t) for name, t in _state(Net()).items()}
    values["head.weight"] = values["embed.weight"]
    return values


@pytest.mark.parametrize("set_masters", [True, False])
def test_values_loaded_into_an_engine_are_what_it_gives_back(build, set_masters):
    model = _net()
    before = _state(model)
    build(model)
    new = _other_values()
    zero_engine.load_values_into_engine(model, new, set_masters=set_masters)
    got = zero_engine.GatheredValues(model, lambda name, tensor: tensor)
    got = {name: got[name] for name in sorted(got)}
    masters = new if set_masters else before  # trained parameters are read from the masters
    trained = {*TRAINED, "head.weight"}
    assert_bitwise_equal({n: got[n] for n in sorted(trained)}, {n: masters[n] for n in sorted(trained)})
    assert_bitwise_equal({n: got[n] for n in new if n not in trained}, {n: new[n] for n in new if n not in trained})


def test_set_fp32_masters_sets_each_master_once_bitwise(build):
    model = _net()
    build(model)
    new = _other_values()
    assert zero_engine.set_fp32_masters(model, new) == len(TRAINED)
    got = zero_engine.GatheredValues(model, lambda name, tensor: tensor)
    assert_bitwise_equal({n: got[n] for n in TRAINED}, {n: new[n] for n in TRAINED})


def test_partition_from_values_gives_a_meta_module_zero3_partitions_of_the_values(process_group):
    with torch.device("meta"):
        model = Net()
    values = _other_values()
    zero_engine.partition_from_values(model, values, config=CONFIG, dtype=torch.float32, device=torch.device("cpu"))
    assert model.hidden.weight.numel() == 0 and hasattr(model.hidden.weight, "ds_id")
    assert model.head.weight is model.embed.weight and model.scale.device.type == "cpu"
    got = zero_engine.GatheredValues(model, lambda name, tensor: tensor)
    assert_bitwise_equal({name: got[name] for name in sorted(got)}, values)


# -- the engine's checkpoint files -----------------------------------------------------------------------------------


def test_checkpoint_files_are_those_deepspeed_saves_copied_off_the_engine(build, tmp_path):
    model = _net()
    engine = build(model)
    _step(engine)  # AdamW makes its moments
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    statuses = [p.ds_status for p in model.parameters()]
    assert ZeroParamStatus.AVAILABLE in statuses  # small ones stay gathered between steps: written as placeholders
    names = {id(p): n for n, p in model.named_parameters()}
    files = zero_engine.checkpoint_files(engine, exclude_frozen=False, names=names)
    assert [p.ds_status for p in model.parameters()] == statuses  # the engine left as it was: nothing partitioned
    on_device = zero_engine.checkpoint_device_specs(engine, exclude_frozen=False, names=names)
    assert (on_device == []) == (engine.device.type == "cpu")  # on the CPU: nothing to prepare host memory for
    engine.save_checkpoint(str(tmp_path), tag="saved")
    assert sorted(files) == sorted(os.listdir(tmp_path / "saved"))
    (optim,) = [name for name in files if "optim_states" in name]
    recipes = files[optim]["optimizer_state_dict"]["fp32_flat_groups"]
    assert recipes and all(isinstance(r, zero_engine.PartitionRecipe) for r in recipes)  # kept as recipes
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().cpu() for n, p in model.named_parameters()
               if p.requires_grad}  # what the module holds after a stage's end
    built = zero_engine.built_partitions(files, masters)
    engine_tensors = {t.data_ptr() for t in zero_engine.tensors_in(engine.optimizer.state_dict())}
    for name, kept in built.items():
        saved = torch.load(tmp_path / "saved" / name, map_location="cpu", weights_only=False)
        assert sorted(saved) == sorted(kept), name
        ours, theirs = list(zero_engine.tensors_in(kept)), list(zero_engine.tensors_in(saved))
        assert len(ours) == len(theirs) > 0, name
        assert_bitwise_equal(dict(enumerate(ours)), dict(enumerate(theirs)))
        held = {t.data_ptr() for t in zero_engine.tensors_in(files[name])}
        if engine.device.type == "cuda":
            assert not held & engine_tensors, name  # copies of their own, off the device
        elif name == optim:  # on the CPU the engine's own moments, which nothing writes once it is gone
            assert held and held <= engine_tensors, name


def test_host_copies_are_private_and_keep_the_containers():
    weight = torch.arange(6, dtype=torch.float32)
    state = {"optimizer_state_dict": OrderedDict(state={0: {"exp_avg": weight}}, groups=[weight, (weight, 3)]),
             "loss_scaler": object(), "step": 7}
    copies: list = []
    host = zero_engine.to_host(state, copies)
    assert type(host["optimizer_state_dict"]) is OrderedDict
    copied = host["optimizer_state_dict"]["state"][0]["exp_avg"]
    weight.add_(1)  # the engine's tensor changes: the kept copy does not
    assert torch.equal(copied, torch.arange(6, dtype=torch.float32))
    assert isinstance(host["optimizer_state_dict"]["groups"][1], tuple)
    assert host["loss_scaler"] is state["loss_scaler"] and host["step"] == 7
    assert len(copies) == 3


def test_a_destroyed_engines_module_leaves_deepspeeds_global_module_stack(process_group):
    from deepspeed.runtime.zero import parameter_offload

    model = _net()
    engine, *_ = deepspeed.initialize(model=model, config=dict(CONFIG))
    engine(torch.tensor([[1, 2, 3]], device=engine.device))
    model.hidden.register_forward_hook(_fail)
    with pytest.raises(ValueError):  # a forward that fails half-way leaves its submodules on the stack too
        engine(torch.tensor([[1, 2, 3]], device=engine.device))
    ours = {id(sub) for sub in model.modules()}
    assert sum(id(entry) in ours for entry in parameter_offload.FWD_MODULE_STACK) >= 2  # what DeepSpeed leaves
    zero_engine.destroy_engine(engine)
    zero_engine.strip_deepspeed_state(model, None)
    assert not any(id(entry) in ours for entry in parameter_offload.FWD_MODULE_STACK)


def _fail(module, args, output):
    raise ValueError("a forward that fails")


def test_a_module_is_placed_on_its_engines_gpu_only_where_deepspeed_would_move_it_itself():
    model = _net()
    assert not zero_engine.place_for_engine(model, torch.device("cpu"))  # nothing to place: the CPU engine casts here
    model.hidden.weight.ds_id = 0  # as zero.Init leaves a parameter: DeepSpeed places such a module itself
    assert not zero_engine.place_for_engine(model, torch.device("cuda", 0))
    del model.hidden.weight.ds_id
    with torch.device("meta"):
        assert not zero_engine.place_for_engine(Net(), torch.device("cuda", 0))
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_module_placed_on_the_gpu_before_its_engine_keeps_its_values():
    model = _net()
    before = _state(model)
    assert zero_engine.place_for_engine(model, torch.device("cuda", torch.cuda.current_device()))
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert_bitwise_equal({n: t.cpu() for n, t in _state(model).items()}, before)
