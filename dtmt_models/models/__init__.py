"""The models: the parts the systems share (seq2seq interface and readout, the attentional RNMT skeleton and its
fused decoder, attention, embeddings, the loss), the systems (`systems/`, one file per paper), the registry
(`build_model`), the presets and the papers' named configurations (`presets`, `catalog`), checkpoints, and the
ATR gate analysis of paper 004."""
