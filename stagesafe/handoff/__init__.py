"""The handoff format, on its own: shard planning, the safetensors codec and fsspec storage.

Nothing here knows about Lightning, DeepSpeed or a running job: the strategy, the CLI and the public
functions all read and write handoffs through :mod:`stagesafe.handoff.store`.
"""
