"""Unlimiformer-style retrieval for decoder-only models (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3).

A decoder-only model reads the whole book as its prompt. Every full-attention layer keeps the
prompt's post-rotary keys and values in a 16-bit store, and every query attends, in one softmax,
to three parts: the sinks (the prompt's start, where the instruction is), an exact local window
(the last W tokens: the end of the text, the request, everything generated), and the top-k far
tokens per key-value head. With k at least the number of far tokens this is the model's own
attention, exactly.

    plan.py       the window, sinks, k, position regime and placement of one prompt
    store.py      one layer's keys and values, [G, N, D] in 16 bits
    selection.py  top-k far tokens per KV head: by tokens (generation, exact prefill) or by blocks
    parts.py      one softmax over sinks, far tokens and the local window
    positions.py  true positions or a fixed distance; rotary frequencies pinned across chunks
    cache.py      RetrievalCache: a transformers Cache whose full layers hold the store
    sliding.py    the cache of a sliding-window layer: its window only
    attention.py  the attention function registered with transformers' AttentionInterface
    reading.py    chunked prefill, then the model's own generate()
"""
