"""Batch orders: which indices each batch holds, for every rank, and how an order resumes.

The seeded order and torch sampler replay (`sampling`), the choice of order for a run's rank and
the saved-state checks (`choice`), the wide index shuffle (`index_shuffle`), the next epoch's
order computed ahead (`ahead`), and the samplers fastload ships: `bucketing`
(`TokenBudgetBatchSampler`) and `shard_shuffle` (`ShardWindowSampler`).
"""
