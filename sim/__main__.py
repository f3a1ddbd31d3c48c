"""`python -m sevendb.sim --seed N` | `--seeds COUNT --time-budget S` (see docs/sim.md)."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
