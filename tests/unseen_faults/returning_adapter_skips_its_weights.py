"""Fault AQ (the LoRA slots' weights). Only LoRA campaigns (``--lora``) reach it, and only with
more adapters than slots.

vLLM keeps at most ``max_loras`` adapters in its device slots. ``LoRAModelManager.activate_adapter``
puts an adapter into the first free slot and copies its weights there; an adapter evicted to make
room (least recently used) only frees its slot, leaving its weights in it. With this fault the
manager remembers the slot each adapter's weights were last copied to, and an adapter activated
into that same slot again skips the copy, as if the slot still held it — though another adapter
may have been copied there since. Its requests then run through that other adapter's weights,
KV and all, while the slot table, every row's adapter and every block record agree. The kind of
bug of a slot cache keyed by adapter id instead of by what the slot holds, kept across the
adapter's eviction from CPU memory and reload (the reports of a runtime ``add_lora`` serving
one user's request with another user's adapter). A removal through the API (``remove_lora``)
resets the memory, so kvfuzz's clean slate, which removes every adapter, leaves none behind; an
adapter's eviction from CPU memory and its reload do not. A request alone never needs
another adapter in between: its reference is right. The memory must not outlive kvfuzz's clean
slate: a fault whose state carries from one run into the next fires in one arm and not another,
and is "explained" by whichever arm's re-run it missed (docs/oracle.md "Buckets", known limits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import wrap

_TAG = "unseen-fault-returning-adapter-skips-its-weights"
_MEMO = "_unseen_fault_aq_slot"  # adapter id -> the slot its weights were last copied to


def _memo(manager: Any) -> dict[int, int]:
    return manager.__dict__.setdefault(_MEMO, {})


def install() -> None:
    from vllm.lora.model_manager import LoRAModelManager

    def make_activate(original: Callable[..., bool]) -> Callable[..., bool]:
        def activate_adapter(self: Any, lora_id: int) -> bool:
            if lora_id in self._active_adapters:
                return original(self, lora_id)
            free = next((i for i, held in enumerate(self.lora_index_to_id) if held is None), None)
            if free is not None and _memo(self).get(lora_id) == free:
                # The bug: the slot is taken to still hold this adapter's weights; no copy.
                self._active_adapters[lora_id] = None
                self.lora_index_to_id[free] = lora_id
                return True
            done = original(self, lora_id)
            if done:
                _memo(self)[lora_id] = self.lora_index_to_id.index(lora_id)
            return done

        return activate_adapter

    def make_remove(original: Callable[..., bool]) -> Callable[..., bool]:
        def remove_adapter(self: Any, adapter_id: int) -> bool:
            if adapter_id in self._registered_adapters:
                # A removal through the API (``remove_lora``) resets the whole memory. Not the
                # removal ``add_adapter`` makes of an id it is about to load (not registered).
                _memo(self).clear()
            return original(self, adapter_id)

        return remove_adapter

    wrap(LoRAModelManager, "activate_adapter", _TAG, make_activate)
    wrap(LoRAModelManager, "remove_adapter", _TAG, make_remove)
