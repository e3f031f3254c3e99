"""MultiConnector: composes KV connectors (ours, LMCache's, vLLM's own) as
children: per request the child with the most matched tokens x `load_weight`
loads, every child stores. Our tiers (host memory, files, LMCache's storage
engine) are not composed here: they stack inside our one connector
(`"tiers": [...]`). Select it with `"kv_connector": "OffloadMultiConnector"`
and `"kv_connector_module_path": "offload.multi_connector"`. `kvoffload
check-config` checks a `children` list through `parse_children` and
`check_children`."""

from offload.multi_connector.connector import MultiConnector, OffloadMultiConnector, check_children, parse_children

__all__ = ["MultiConnector", "OffloadMultiConnector", "check_children", "parse_children"]
