"""DeepSpeed: a live engine's internals (:mod:`.engine`, the one file that touches them) and ZeRO checkpoint
folders on disk (:mod:`.checkpoint`), read without running pickled code (:mod:`.safe_pickle`)."""
