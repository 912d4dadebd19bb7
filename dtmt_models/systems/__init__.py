"""The NMT systems; each module registers its models with dtmt_models.registry on import."""
from . import atr, deeplau, dtmt, mce, nematus, transformer  # noqa: F401
