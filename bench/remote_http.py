"""`python -m bench.remote_http`: the same as `python -m bench.remote --server nginx` (kept for old commands)."""

from __future__ import annotations

from bench.remote import Nginx, main

__all__ = ["Nginx", "main"]

if __name__ == "__main__":
    main()
