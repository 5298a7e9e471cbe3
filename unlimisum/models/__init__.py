"""Model surgery: loading a checkpoint, the table of architectures, wrapping attention modules,
and the differences between transformers releases (compat), kept apart from the method itself.

- ``loading``: ``load_model`` (hub name or folder, safe weights, device, dtype) -> ``LoadedModel``;
- ``hub``: a hub name's files fetched into the Hugging Face cache first (progress events, failing fast);
- ``checkpoint``: what a model name points at, and one-line diagnoses of what is wrong with it;
- ``tokens``: a document's text tokenized as text, never as the tokenizer's special tokens;
- ``architectures``: one row per encoder-decoder family (where the attentions live, their names);
- ``wrapping``: install and remove wrapper modules with setattr, never stacked;
- ``compat``: everything that differs between supported transformers releases.
"""

from unlimisum.models.loading import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["LoadedModel", "load_model", "resolve_device", "resolve_dtype"]
