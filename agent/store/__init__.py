"""The node's content-addressed store: ``layout`` (the Store: blobs, versions, publishing),
``partial`` (files being pulled and the journal of their verified pieces), ``space`` (cleaning,
eviction, gc), ``evict`` (the pure choice of what leaves), ``pointers`` (the current version and
pins), ``verify`` (re-hashing what is published)."""

from agent.store.layout import Removed, Store, StoreError, VersionInfo

__all__ = ["Removed", "Store", "StoreError", "VersionInfo"]
