"""Decoding as library functions: beam search over a model's inference decoder (`beam_search`), translating
sentences with a trained model (`translate`) and scoring translations with sacrebleu (`evaluate`)."""
