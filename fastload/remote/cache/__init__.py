"""The byte-budget shard cache on local disk.

`shard_cache` (`ShardCache`, the public face), `state` (state store and pin ledger),
`policy` (eviction), `fill` (download, verify, rename) and `files` (temp files, hashes).
"""
