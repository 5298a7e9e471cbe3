"""One row per decoder-only family: what unlimisum's decoder-only retrieval reads of the model.

The retrieval itself needs nothing family-specific: it runs inside transformers' attention
interface, which hands it the post-rotary queries, keys and values of every layer, and in a
Cache subclass, which every family's attention updates. A row says what differs around that:
where the rotary embedding is (to pin dynamic frequencies and to place retrieved tokens at a
fixed distance). Which layers attend to a sliding
window comes from the config (``layer_types`` or ``sliding_window``), as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from unlimisum.errors import UnsupportedModelError

# Layer types whose attention unlimisum knows: full attention retrieves, sliding attention keeps its window.
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class DecoderOnlyArchitecture:
    """One decoder-only family (``AutoModelForCausalLM``)."""

    kind: ClassVar[str] = "decoder-only"
    name: str
    model_types: tuple[str, ...]
    rotary_attribute: str = "rotary_emb"  # the rotary embedding module on ``model.get_decoder()``

    def max_positions(self, config) -> int:
        """Positions the model was trained with: its ``max_position_embeddings``."""
        return int(config.max_position_embeddings)

    def layer_windows(self, config) -> list[int | None]:
        """Per layer: None for full attention, else its sliding window in tokens.

        A window at least as long as the model's positions is full attention (Phi-3.5's 262,144 on 131,072
        positions). UnsupportedModelError when no layer is full attention: there is nothing to retrieve into.
        """
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:
            types = [SLIDING if window else FULL] * config.num_hidden_layers
        windows = []
        for layer_type in types:
            if layer_type not in (FULL, SLIDING):
                raise UnsupportedModelError(f"model type '{config.model_type}' has '{layer_type}' layers, which "
                                            "unlimisum's decoder-only retrieval does not know")
            sliding = layer_type == SLIDING and window and window < self.max_positions(config)
            windows.append(int(window) if sliding else None)
        if all(w is not None for w in windows):
            raise UnsupportedModelError(
                f"every layer of this '{config.model_type}' model attends to a sliding window of {window} tokens "
                "only, so no layer can retrieve from the rest of the text; use a checkpoint with full-attention "
                "layers (e.g. Phi-3-mini-128k rather than -4k, Mistral v0.3 rather than v0.1)")
        return windows

    def decoder(self, model: nn.Module) -> nn.Module:
        """The model without its language-model head (``LlamaModel`` in ``LlamaForCausalLM``)."""
        return model.get_decoder()

    def rotary(self, model: nn.Module) -> nn.Module:
        """The rotary embedding module that computes every layer's cos and sin."""
        return getattr(self.decoder(model), self.rotary_attribute)


DECODER_ONLY_ARCHITECTURES: tuple[DecoderOnlyArchitecture, ...] = (
    DecoderOnlyArchitecture("Llama", ("llama",)),
    DecoderOnlyArchitecture("Qwen2", ("qwen2",)),
    DecoderOnlyArchitecture("Qwen3", ("qwen3",)),
    DecoderOnlyArchitecture("Mistral", ("mistral",)),
    DecoderOnlyArchitecture("Phi-3", ("phi3",)),
    DecoderOnlyArchitecture("Gemma 2", ("gemma2",)),
    DecoderOnlyArchitecture("Gemma 3 (text)", ("gemma3_text",)),  # its rotary is called per layer type
)

BY_MODEL_TYPE = {model_type: row for row in DECODER_ONLY_ARCHITECTURES for model_type in row.model_types}
