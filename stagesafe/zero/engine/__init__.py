"""Everything that touches DeepSpeed internals, and nothing else.

DeepSpeed leaves state on the module it wraps: ``ds_*`` attributes and bound methods on every parameter,
``ds_*``/``_external_params`` attributes and a ``ZeROOrderedDict`` on every submodule, forward hooks, and
empty ``.data`` where a ZeRO-3 partition used to be. This package reads the consolidated weights out of a live
engine, loads exact values into one, and takes a module back to the plain state it had before the engine.
When DeepSpeed changes, this is the one place that changes with it. Its files, by job: what a parameter says of
ZeRO (:mod:`.parameters`), the state an engine leaves on a module and taking it away (:mod:`.traces`: footprint,
stale state, strip, destroy), the weights read out of a live engine (:mod:`.values_out`: full specs, gathered
values, fp32 masters) and put into one (:mod:`.values_in`: partitions from values, loaded values, masters set), and
the engine's own checkpoint files (:mod:`.checkpoint_state`; ZeRO-3's fp32 master partitions in them as recipes,
:mod:`.fp32_partitions`), a checkpoint folder of any world size put into a live engine through them
(:mod:`.checkpoint_load`), the user's optimizer given back over the module's parameters (:mod:`.optimizer`), with views into the kept
optimizer state as its state (:mod:`.optimizer_views`), and
DeepSpeed's per-parameter broadcasts of a plain module at engine build made one per bucket (:mod:`.broadcasts`).
Callers use the names below, from this package.
"""

from stagesafe.zero.engine.checkpoint_state import (
    checkpoint_device_specs,
    LaterCopies,
    checkpoint_files,
    checkpoint_files_later,
    foreseen_state_specs,
    tensors_in,
    to_host,
)
from stagesafe.zero.engine.checkpoint_load import (
    load_optimizer_state,
    load_rank_files,
    read_handoff_optimizer,
    read_rank_files,
)
from stagesafe.zero.engine.broadcasts import flat_broadcasts
from stagesafe.zero.engine.fp32_partitions import HeldPartition, PartitionRecipe, built_partitions
from stagesafe.zero.engine.optimizer import OptimizerLayout, optimizer_layout, plain_optimizer, repoint
from stagesafe.zero.engine.optimizer_views import (
    FlatSlices,
    OptimizerViews,
    StatePlaces,
    attach_views,
    numbered_state,
    state_places,
)
from stagesafe.zero.engine.parameters import full_shape, has_fp32_master, is_zero3_param
from stagesafe.zero.engine.traces import (
    ModuleFootprint,
    destroy_engine,
    find_stale_state,
    is_engine,
    strip_deepspeed_state,
    take_footprint,
)
from stagesafe.zero.engine.values_in import (
    cast_beside_zero_init,
    load_values_into_engine,
    partition_from_values,
    place_for_engine,
    set_fp32_masters,
)
from stagesafe.zero.engine.values_out import GatheredValues, full_specs

__all__ = [
    "OptimizerLayout",
    "optimizer_layout",
    "plain_optimizer",
    "repoint",
    "OptimizerViews",
    "StatePlaces",
    "FlatSlices",
    "attach_views",
    "state_places",
    "numbered_state",
    "GatheredValues",
    "full_specs",
    "partition_from_values",
    "place_for_engine",
    "cast_beside_zero_init",
    "ModuleFootprint",
    "take_footprint",
    "find_stale_state",
    "is_engine",
    "has_fp32_master",
    "is_zero3_param",
    "full_shape",
    "set_fp32_masters",
    "load_values_into_engine",
    "destroy_engine",
    "strip_deepspeed_state",
    "checkpoint_files",
    "checkpoint_files_later",
    "LaterCopies",
    "checkpoint_device_specs",
    "foreseen_state_specs",
    "tensors_in",
    "to_host",
    "PartitionRecipe",
    "HeldPartition",
    "built_partitions",
    "read_rank_files",
    "load_rank_files",
    "read_handoff_optimizer",
    "load_optimizer_state",
    "flat_broadcasts",
]
