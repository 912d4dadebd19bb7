"""The data: corpora as aligned text files and their manifest (`corpus`), the embedded Bible (`bible`), writing a
corpus directory (`prepare`), SentencePiece vocabularies (`vocabulary`), the binarized corpus training reads
(`binarized`) and token-budget batches (`batching`)."""
