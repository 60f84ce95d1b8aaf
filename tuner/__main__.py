"""`python -m tileops.tuner ...` is the `tileops` command."""

from .cli import tileops_main

raise SystemExit(tileops_main())
