"""Datasets in object storage: fsspec reads through a local shard cache.

`storage` (`RemoteStorage`), `plan` (the prefetch plan), `get_window` (adaptive GETs in
flight), `receive_loops` (private receive loops), `get` (ranged parts), `retry` (bounded
retries), `transfer_stats` (per-stage transfer statistics); the byte-budget cache is `cache/`.
"""
