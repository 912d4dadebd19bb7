"""`dtmt models`: prints dtmt_models.models.catalog.describe (systems, presets, the papers' table rows)."""
from __future__ import annotations

import sys
from typing import List, Optional

from dtmt_models.errors import ArgumentParser
from dtmt_models.models.catalog import describe
from dtmt_models.models.presets import TABLES


def main(argv: Optional[List[str]] = None) -> int:
    p = ArgumentParser(prog="dtmt models", description="List the systems, their presets and the papers' "
                       "table rows (each a preset: dtmt train --preset ROW), with the papers' parameter counts.")
    p.add_argument("--count", action="store_true",
                   help="also count our parameters for every row with a count in the paper (Δ: against the table's "
                        "first such row; differences do not depend on the vocabulary)")
    p.add_argument("--table", choices=sorted(TABLES), help="one table only")
    args = p.parse_args(argv)
    if sys.stdout is None:   # (started with stdout closed, `>&-`: the list went nowhere, exit 0)
        print("dtmt models: stdout is closed; nowhere to print the list", file=sys.stderr)
        return 2
    print(describe(args.count, args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
