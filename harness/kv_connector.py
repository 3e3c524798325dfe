"""``HMAStoreConnector``: kvfuzz's own KV connector, hybrid-aware (``SupportsHMA``).

vLLM loads it by module path (``kv_connector_module_path="kvfuzz.harness.kv_connector"``) when a
trace's engine has ``kv_connector: "kvfuzz-store"`` (harness/vllm_args.py). It exists because
none of vLLM's own connectors gives external KV with correct contents on the CPU build while
keeping several KV cache groups (docs/hybrid.md).

What it does (synchronous, block-granular, per KV cache group):

* save: each step, every prompt block that becomes full is copied, per group, from the paged
  KV cache into an in-process store (worker side, ``wait_for_save``: after the forward wrote
  it). Sliding-window blocks are copied while the window still holds them.
* match: ``get_num_new_matched_tokens`` offers the longest whole-block prefix P (< the
  request's length) whose blocks are all stored for every group: full-attention groups need
  blocks [0, P), sliding-window groups only those their window keeps at P.
* load: ``update_state_after_alloc`` records which block ids the engine allocated for
  [local hit, P); ``start_load_kv`` copies the stored blocks in before the forward (vLLM
  flags the loads as synchronous).

The store is process memory shared by the scheduler-role and worker-role instances: on the
CPU build both live in the EngineCore process. ``reset_cache`` (reached through
``reset_prefix_cache(reset_connector=True)`` / ``POST /reset_prefix_cache?reset_external=true``)
empties it, so every run of a trace starts from an empty store. Limits: keys ignore LoRA,
cache_salt and multimodal inputs (kvfuzz refuses a connector with LoRA); all groups must share
one block size; only whole prompt blocks are stored; nothing is evicted within a run.

Imports vLLM and torch: only the EngineCore imports this module.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import SlidingWindowSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# namespace -> {(group, key): per-layer block tensors in the group's layer order}
STORES: dict[str, dict[tuple[int, bytes], list[torch.Tensor]]] = defaultdict(dict)
# Process-wide counters (tests and docs read them; never reset, compare differences).
COUNTERS: dict[str, int] = defaultdict(int)


@dataclass
class StoreMeta(KVConnectorMetadata):
    loads: list[tuple[int, bytes, int]] = field(default_factory=list)  # (group, key, block id)
    saves: list[tuple[int, bytes, int]] = field(default_factory=list)


def block_keys(namespace: str, token_ids: Any, block_size: int, num_blocks: int) -> list[bytes]:
    """Chain hash per block: block i's key covers tokens [0, (i+1) * block_size)."""
    keys, h = [], hashlib.sha1(namespace.encode()).digest()
    for i in range(num_blocks):
        blk = token_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.sha1(h + b"".join(int(t).to_bytes(4, "little") for t in blk)).digest()
        keys.append(h)
    return keys


class HMAStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        assert kv_cache_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.namespace = str(extra.get("namespace", vllm_config.model_config.model))
        self.store = STORES[self.namespace]
        self.groups = kv_cache_config.kv_cache_groups
        self.block_size = self.groups[0].kv_cache_spec.block_size
        if any(g.kv_cache_spec.block_size != self.block_size for g in self.groups):
            raise ValueError("HMAStoreConnector needs one block size for all KV cache groups")
        self.is_swa = [isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in self.groups]
        self.num_blocks = kv_cache_config.num_blocks
        # scheduler side
        self._reqs: dict[str, "Request"] = {}
        self._match: dict[str, tuple[int, int]] = {}  # request id -> (local hit, P)
        self._loads: list[tuple[int, bytes, int]] = []
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._factor = 1  # kernel blocks per scheduler block

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = kv_caches
        first = next(iter(kv_caches.values()))
        assert first.shape[0] % self.num_blocks == 0, (first.shape, self.num_blocks)
        self._factor = first.shape[0] // self.num_blocks

    def _blk(self, layer: str, block_id: int) -> torch.Tensor:
        f = self._factor
        return self._kv[layer][block_id * f:(block_id + 1) * f]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMeta)
        for g, key, bid in meta.loads:
            for layer, t in zip(self.groups[g].layer_names, self.store[(g, key)]):
                self._blk(layer, bid).copy_(t)
            COUNTERS["blocks_loaded"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMeta)
        for g, key, bid in meta.saves:
            if (g, key) not in self.store:
                self.store[(g, key)] = [self._blk(layer, bid).clone() for layer in self.groups[g].layer_names]
                COUNTERS["blocks_saved"] += 1

    # -- scheduler side ----------------------------------------------------------------------
    def _needed_blocks(self, g: int, num_tokens: int) -> range:
        """Block indices group ``g`` holds (not null) once ``num_tokens`` are computed."""
        skipped = 0
        if self.is_swa[g]:
            manager = self._kv_cache_manager.coordinator.single_type_managers[g]
            skipped = manager.get_num_skipped_tokens(num_tokens)
        return range(skipped // self.block_size, num_tokens // self.block_size)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
        keys = block_keys(self.namespace, request.all_token_ids, bs, max_blocks)
        best = 0
        for k in range(max_blocks, num_computed_tokens // bs, -1):
            if all((g, keys[i]) in self.store for g in range(len(self.groups)) for i in self._needed_blocks(g, k * bs)):
                best = k * bs
                break
        if best <= num_computed_tokens:
            self._match.pop(request.request_id, None)
            return 0, False
        self._match[request.request_id] = (num_computed_tokens, best)
        return best - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        local, end = self._match.pop(request.request_id)
        assert local + num_external_tokens == end, (local, num_external_tokens, end)
        bs = self.block_size
        keys = block_keys(self.namespace, request.all_token_ids, bs, end // bs)
        for g, group_blocks in enumerate(blocks.blocks):
            for i in range(local // bs, end // bs):
                if not group_blocks[i].is_null:
                    self._loads.append((g, keys[i], group_blocks[i].block_id))
        COUNTERS["external_tokens"] += num_external_tokens
        COUNTERS["external_requests"] += 1

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = StoreMeta(loads=self._loads)
        self._loads = []
        bs = self.block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._reqs.get(req_id)
            if req is None:
                continue
            done = req.num_computed_tokens  # not yet advanced by this step
            first, last = done // bs, min(done + n, req.num_prompt_tokens) // bs  # blocks filled now
            if last <= first:
                continue
            keys = block_keys(self.namespace, req.prompt_token_ids, bs, last)
            for g, blks in enumerate(self._kv_cache_manager.get_blocks(req_id).blocks):
                for i in range(first, min(last, len(blks))):
                    if not blks[i].is_null and (g, keys[i]) not in self.store:
                        meta.saves.append((g, keys[i], blks[i].block_id))
        return meta

    def on_new_request(self, request: "Request") -> None:
        self._reqs[request.request_id] = request

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request)
        return False, None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request)
        return False, None  # saves are synchronous: no delayed free

    def _forget(self, request: "Request") -> None:
        self._reqs.pop(request.request_id, None)
        self._match.pop(request.request_id, None)

    def reset_cache(self) -> bool:
        self.store.clear()
        return True
