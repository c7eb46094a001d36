"""The bases :class:`~stagesafe.strategy.StageSafeDeepSpeedStrategy` is made of: Lightning's DeepSpeed strategy,
able to run on CPU processes (:mod:`~stagesafe.strategy_bases.cpu_strategy`, with the watch on DeepSpeed's CPU comm
op build, :mod:`~stagesafe.strategy_bases.comm_op_build`), and over it one concern of Lightning's strategy each,
through the strategy's :class:`~stagesafe.stages.call_series.CallSeries` (``call_series``, what its Trainer calls
share):

- :mod:`~stagesafe.strategy_bases.checkpoint_hooks`: ``trainer.save_checkpoint`` during a stage and between calls,
  a ``ckpt_path`` loaded, the engine a callback asks for;
- :mod:`~stagesafe.strategy_bases.guarded_collectives`: Lightning's collectives, each inside the guard of
  :mod:`~stagesafe.stages.collective_guard`;
- :mod:`~stagesafe.strategy_bases.handoff_waits`: the handoff's write as the user sees it (``wait_for_handoff``,
  ``acknowledge_handoff_failure``, ``last_boundary``) and the Trainer's last hook of a call;
- :mod:`~stagesafe.strategy_bases.process_groups_at_exit`: the process groups DeepSpeed started for the strategy,
  ended as the interpreter exits.
"""
