"""`epd-router`: the router's commands (router/cli.py: serve, check-config, status) and the
advisor's (advise/cli.py: advise, docs/advisor.md) under one name.

The two meet here, above both: the advisor reads the router's metric names (advise -> router),
so the router may not import the advisor back (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

from epd_kit.advise.cli import advise
from epd_kit.router.cli import main

main.add_command(advise)

__all__ = ["main"]

if __name__ == "__main__":
    main()
