"""dtmt_models: the recurrent NMT systems of the five papers, built on dtmt_kernels (SPEC §4).

    import dtmt_models as dm
    model = dm.build_model("dtmt", src_vocab_size, tgt_vocab_size, depth=4, cell="lgru")
    dm.list_models(); dm.summary(model)
"""
from dtmt_models.models.registry import build_model, list_models, register_model
from dtmt_models.models.seq2seq import Seq2Seq, summary

__all__ = ["build_model", "list_models", "register_model", "Seq2Seq", "summary"]
