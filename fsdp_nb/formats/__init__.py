"""Checkpoint file formats: pure code that imports neither the notebook side nor the
engines, so the engines' save and load, the notebook's driver and offline tools
(``fsdp_nb.inspect``, the CLI) all read and write the same way.

The folder commit (``atomic``), per-item checksums (``checksums``), DCP reading
(``dcp_reader``, ``reader``, ``item_tensor``, ``item_scan``, ``item_files``: a remote
file's items fetched once), full files (``fullfile``), safetensors
(``safetensors_layout``, ``safetensors_write``), checkpoint metadata (``metadata``,
``info``, ``inspect``, ``listing``, ``keys``), the unpicklers that cannot run code nor
allocate by a count (``pickles``, ``restricted``, ``pickle_counts``), each rank's own state (``run_state``, torchtitan's loader
in ``titan_loader``), storage and disk I/O (``storage``, ``direct_io``,
``writeback``, ``helper_threads``) and dtype names (``dtypes``).
"""
