"""The Unlimiformer method, in the order a book goes through it.

- ``encoding``: the window plan and batched encoding (every token kept once, with context);
- ``encoder``: document -> ``EncodedDocument`` (tokenize, encode, store), once, or from the cache;
- ``encoded``: the encoded document, its windows and chapter token ranges;
- ``cache``: the cache of encoded books on disk;
- ``placement``: which index holds the states and where (the index policy);
- ``datastore``: the one 16-bit copy of the states: search, attention, views of a token range;
- ``kernels``: exact retrieval attention in one streaming pass per layer, measured per machine;
- ``retrieval``: the cross-attention wrapper that reads the store;
- ``coverage``: where a summary looked.
"""
