"""The NMT systems; each module registers its models with dtmt_models.models.registry on import."""
from dtmt_models.models.systems import atr, deeplau, dtmt, mce, nematus, transformer  # noqa: F401
