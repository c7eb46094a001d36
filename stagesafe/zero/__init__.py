"""DeepSpeed: a live engine's internals (:mod:`.engine`, the one file that touches them) and ZeRO checkpoint
folders on disk (:mod:`.checkpoint`), whose pickles are interpreted without running anything they name and
without torch (:mod:`.pickle_reader`; what it builds: :mod:`.pickle_globals`, :mod:`.pickle_user_values`,
:mod:`.pickle_policy`; its bounds: :mod:`.pickle_limits`); a rank file's zip archive, :mod:`.rank_file`."""
