"""`python -m dtmt_models.cli COMMAND ...`: the same as the `dtmt` console script."""
import sys

from dtmt_models.cli import main

sys.exit(main())
