"""MultiConnector: composes offload tiers (CPU, filesystem, LMCache) by matched
tokens x load weight. Select it with `"kv_connector": "OffloadMultiConnector"`
and `"kv_connector_module_path": "offload.multi_connector"`."""

from offload.multi_connector.connector import MultiConnector, OffloadMultiConnector

__all__ = ["MultiConnector", "OffloadMultiConnector"]
