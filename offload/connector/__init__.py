"""The OffloadConnector package, loaded by vLLM through
`kv_connector_module_path: "offload.connector"` in the API server, the engine
core and every worker: vLLM takes `OffloadConnector` from this module. It also
exports the two names a MultiConnector of several of ours needs (the step's
`OffloadMetadata` and the `SharedGathers` seam), so that no other package
reaches into the modules below. Importing it defines classes and registers the
connector's name with vLLM's factory; it starts nothing.

- connector.py: the vLLM hooks, forwarding to the two halves;
- scheduler.py / worker.py: the scheduler half (lookup, planning) and the
  worker half (bytes), told each step by metadata.py's jobs;
- requests.py / store_plan.py: the scheduler half's per-request state and
  keys, and its store planning;
- kv_gate.py: sleep mode's gate on the worker's copies;
- room.py: whether an async load has room in vLLM's KV cache to finish;
- startup.py: start-up advice in the log.
"""

from offload.connector.connector import OffloadConnector
from offload.connector.metadata import OffloadMetadata
from offload.connector.stores import SharedGathers

__all__ = ["OffloadConnector", "OffloadMetadata", "SharedGathers"]
