"""The machinery of one Trainer call's passage under :mod:`stagesafe.strategy`: the stage boundary, the
background handoff writer, host memory, and the ranks agreeing through the job's key-value store."""
