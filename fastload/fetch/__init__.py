"""The fetch stage's work for one batch: indices -> dataset reads -> collate -> transform.

`fetcher` (`Fetcher`: the per-batch path and the direct path), `plan` (`EpochPlan`: an
epoch's lookups read at once), `collate` (default collation), `views` (`BatchViews`) and
`text_collate` (padded / packed text batches).
"""
