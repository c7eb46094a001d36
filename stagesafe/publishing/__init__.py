"""Publishing a handoff, the format's steps composed (:mod:`stagesafe.handoff` holds the steps themselves):

- :mod:`~stagesafe.publishing.commit`: the one commit protocol, plan -> shards -> commit (the manifest, then the
  index), for one process or several ranks (their shard records exchanged by a transport the caller gives), and
  what the commit replaced deleted after it.
- :mod:`~stagesafe.publishing.save`: ``save_state_dict`` and ``save_streamed``, one process's saves.
- :mod:`~stagesafe.publishing.verify`: ``verify``, every shard of a committed handoff re-hashed, the index
  checked against the manifest (and rewritten to follow it, if asked).

No running job here: the strategy's writer (:mod:`stagesafe.stages.shared_write`) gives the protocol its transport.
"""
