"""The handoff format, on its own: safetensors shards, a Hugging Face index and a manifest, on any fsspec URL.

Nothing here knows about Lightning, DeepSpeed or a running job: the strategy, the CLI and the public functions
all read and write handoffs through these modules, one job each (publishing a handoff, the steps composed, is
:mod:`stagesafe.publishing`'s):

- The format's rules, pure: :mod:`~stagesafe.handoff.names` (which file is what),
  :mod:`~stagesafe.handoff.sizes` (``max_shard_size``), :mod:`~stagesafe.handoff.index` (Hugging Face's
  index), :mod:`~stagesafe.handoff.manifest` (the commit's record, built and validated),
  :mod:`~stagesafe.handoff.codec` (the safetensors header), :mod:`~stagesafe.handoff.digest` (the shards' hashes).
- :mod:`~stagesafe.handoff.plan`: which tensor goes to which shard, one builder for every path;
  :mod:`~stagesafe.handoff.tensor_plan`: a state dict's plan.
- :mod:`~stagesafe.handoff.shards`: writing shard files, the one parallel shard writer.
- :mod:`~stagesafe.handoff.read`: ``read_manifest``, ``load_state_dict``, ``HandoffReader``, ``check_present``.
- :mod:`~stagesafe.handoff.cleanup`: leftovers of failed writers, and what must never be deleted.

Every storage call goes through :mod:`stagesafe.storage`, which knows nothing of this format.
"""
