"""The inference engine (issue 75): what a trained model becomes for decoding, chosen once when it is exported for
inference. So far the Decoder protocol every search drives (decoder.py: Decoder, as_decoder) and the fused decoder's
switches (options.py: EngineOptions); the frozen forms, the decode-step ops and the searches are to move here."""
from .decoder import AdaptedDecoder, Decoder, as_decoder
from .options import EngineOptions

__all__ = ["AdaptedDecoder", "Decoder", "EngineOptions", "as_decoder"]
