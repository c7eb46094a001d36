"""Storage on any fsspec URL, knowing nothing of what the files hold: the handoff format (:mod:`stagesafe.handoff`)
and DeepSpeed's checkpoint folders (:mod:`stagesafe.zero`) both stand on it.

- :mod:`~stagesafe.storage.folder`: a folder (file system, path, retry policy) and the storage calls every step
  makes, each tried again on transient errors; the one parallel loop over a folder's files.
- :mod:`~stagesafe.storage.fs`: fsspec itself: URLs resolved with clear backend errors, listings, atomic writes;
  :mod:`~stagesafe.storage.temp_names`: the temporary name a file is written under.
- :mod:`~stagesafe.storage.retry`: which errors are transient, and the policy that retries them.
- :mod:`~stagesafe.storage.safe_files`: opening only regular files inside a folder.
- :mod:`~stagesafe.storage.workers`: the thread pool; :mod:`~stagesafe.storage.writeback`: early write-back.
"""
