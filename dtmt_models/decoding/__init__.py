"""Decoding as library functions, a module each: beam search over a model's inference decoder
(`beam_search.beam_search`), translating sentences with a trained model (`translate.translate`,
`translate.translate_best`) and scoring translations with sacrebleu (`evaluate.corpus_scores`, ...). The package
imports none of them: `from dtmt_models.decoding.translate import translate`."""
