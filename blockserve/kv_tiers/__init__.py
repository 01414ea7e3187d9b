"""Stores below the device KV cache (host memory, disk, a store every replica shares), keyed by
the block hash. The package imports nothing itself (shared.py's schemes are read without torch).

Modules:

  store.py        LocalStore and SharedStore (the two interfaces), Read and Write (what a call
                  did), Tier (a store and the counters it keeps), BlockShape, FilledBlock, the
                  checksummed record of a stored block
  host.py         HostStore: host memory (pinned with CUDA), bytes-bounded LRU
  disk.py         DiskStore: one checksummed file per block, written by rename, LRU order kept
                  in file times across restarts
  manifest.py     the disk directory's fingerprint, lock and warm-restart rules
  remote.py       RemoteStore: a Redis-protocol store every replica shares, namespaced by the
                  fingerprint, marked down and retried with backoff on faults
  shared.py       the shared store a URL's scheme names
  offload.py      KVTiers: local tiers and at most one shared one; writer and loader threads,
                  lookup host → disk → remote
  tier_events.py  the tiers' KV events, one recorder per local tier
"""
