"""MultiConnector: composes offload tiers (CPU, filesystem, LMCache) by matched
tokens x load weight. Next milestone; see docs/architecture.md."""
