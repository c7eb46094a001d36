"""The machinery of one Trainer call's passage under :mod:`stagesafe.strategy`: the stage boundary, the
background handoff writer, host memory, and the ranks agreeing with each other. It knows no Lightning.

How ranks coordinate, one rule (docs/how-it-works.md, "The package, and how ranks coordinate"):

- collectives (:mod:`~stagesafe.stages.collectives`) only on the main thread, at a point every rank reaches
  in step, once this rank's writer needs the device no more (``HandoffWriter.wait_device()``);
- the job's key-value store (:mod:`~stagesafe.stages.channel`) for everything else: whatever a background
  write agrees on, anything off the main thread, any point the ranks may reach out of step; every wait
  bounded by the strategy's timeout.

Only those two modules (and ``zero/``'s gathers) import ``torch.distributed``.
"""
