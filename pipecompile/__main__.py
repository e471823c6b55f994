"""`python -m pipecompile ...`: the same as the `pipecompile` command (see `pipecompile.cli`)."""

from .cli import main

raise SystemExit(main())
