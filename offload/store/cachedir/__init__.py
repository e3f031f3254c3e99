"""One cache directory's machinery, apart from the tiers that use it
(offload/store/files.py, fs.py): the path codec (`paths`), hygiene at open (`hygiene`),
the ledger's logs, snapshots and lease (`ledger`) and its index
(`usage_index`), the reconciling walk (`reconcile`), compaction
(`compaction`), the byte budget that drives them (`budget`), the thread that
runs its passes (`housekeeper`), and the owners of directories, shared by
reference count (`owners`). It knows nothing of tiers but their figures
(offload/store/tier_usage.py). Imports nothing, so that importing one module
of it costs only that module.
"""
