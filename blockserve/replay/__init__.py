"""Trace replay: drive the real block pool with a request trace, next to the optimal bounds."""
