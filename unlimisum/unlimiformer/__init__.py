"""The Unlimiformer method for encoder-decoder models, in the order a book goes through it.

- ``encoding``: the window plan and batched encoding (every token kept once, with context);
- ``encoder``: document -> ``EncodedDocument`` (tokenize, encode, store), once, or from the cache;
- ``encoded``: the encoded document, its windows and chapter token ranges;
- ``cache``: the cache of encoded books on disk;
- ``placement``: which index holds the states and where (the index policy);
- ``datastore``: the one 16-bit copy of the states: search, attention, views of a token range;
- ``kernels``: exact retrieval attention in one streaming pass per layer, measured per machine;
- ``retrieval``: the cross-attention wrapper that reads the store;
- ``summarize``: document -> ``Summary`` (the whole book, then its chapters in batches of views),
  what ``unlimisum.Summarizer`` hands encoder-decoder models to.

Where a summary looked (coverage) and the chapters' token ranges are in ``unlimisum.coverage``,
shared with ``unlimisum.decoder_only``.
"""
