"""The inference engine: what a trained model becomes for decoding, chosen once when it is exported for inference.

    ops.py       the decode-step ops (attention step, readout features, a whole RNMT step, beam search, mce's memory
                 encoder; C++ in csrc/engine/) and the weight structures they take
    forms.py     the frozen forms that stand in for a model's modules, and inference_form(module)
    decoder.py   the Decoder protocol every search drives, as_decoder, AutocastDecoder (16-bit decoding), built_from
    rnmt.py      FusedRNMTDecoder: the attentional systems' step and beam search as one C++ call each, and
                 FusedStep, what a system class states to get it
    options.py   EngineOptions, the fused decoder's switches

It sits between the kernels (dtmt_kernels, which know nothing of NMT) and the models, which build their forms
from it (docs/design/decoding.md, "The engine as its own layer")."""
from .decoder import AMP_DTYPES, AdaptedDecoder, AutocastDecoder, Decoder, as_decoder, built_from
from .options import EngineOptions

__all__ = ["AMP_DTYPES", "AdaptedDecoder", "AutocastDecoder", "Decoder", "EngineOptions", "as_decoder", "built_from"]
