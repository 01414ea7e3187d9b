"""Trace replay: drive the real block pool with a request trace, next to the optimal bounds.

Modules:

  trace.py           Mooncake traces → per-request block layouts
  simulate.py        replay through KVCacheManager; infinite and Belady bounds
  report.py          table, JSON, plot
  tier_sim.py        device over host and disk tiers, per-tier hit rates
  cluster_sim.py     N KVCacheManagers behind a routing policy, simulated time
  cluster_report.py  replica counts × routers: table, JSON
  command.py         `blockserve replay`'s flags and run (also `blockserve bench replay`)
"""
