"""DeepSpeed: a live engine's internals (:mod:`.engine`, the one file that touches them) and ZeRO checkpoint
folders on disk (:mod:`.checkpoint`), whose pickles are interpreted without running anything they name and
without torch (:mod:`.pickle_reader`, :mod:`.pickle_globals`)."""
