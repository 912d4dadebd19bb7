"""The inference engine (issue 75): what a trained model becomes for decoding, chosen once when it is exported for
inference. So far its options (options.py: EngineOptions, the fused decoder's switches); the frozen forms, the
decode-step ops and the searches are to move here."""
from .options import EngineOptions

__all__ = ["EngineOptions"]
