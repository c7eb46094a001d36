"""DeepSpeed: a live engine's internals (:mod:`.engine`, the one package that touches them) and ZeRO checkpoint
folders on disk: read (:mod:`.checkpoint`; where its rank files are: :mod:`.checkpoint_folder`; what tensors they
hold and where: :mod:`.checkpoint_tensors`; one rank file's zip archive: :mod:`.rank_file`; 16-bit buffers widened:
:mod:`.widen`) and written without an engine (:mod:`.checkpoint_writer`). Their pickles are interpreted without
running anything they name and without torch (:mod:`.pickle_reader`; its opcodes: :mod:`.pickle_interpreter`; what
it builds: :mod:`.pickle_globals`, :mod:`.pickle_user_values`, :mod:`.pickle_policy`; its bounds:
:mod:`.pickle_limits`)."""
