"""Build the Moshi-family model: a tiny random-weight config, or a local checkpoint directory.

``model: tiny`` builds ``transformers``' ``MoshiForConditionalGeneration`` (temporal
transformer over the text + 2 × 8 audio codebook streams, depth transformer per frame, and a
``MimiModel`` codec inside it) from the config below, with random weights seeded from
``seed``: no download, ~0.1 s. Its layer sizes are tiny but the architecture, the codec's
frame rate (12.5 Hz, 1,920 samples at 24 kHz) and the 8 codebooks per stream are Moshi's.

``model: /path/to/dir`` loads a converted Moshi checkpoint from a local directory with
``from_pretrained`` (the ``transformers`` format: ``config.json`` + safetensors, Mimi inside),
e.g. a local copy of Kyutai's Moshi in that format; the text tokens are then read with the
tokenizer in the same directory (see :mod:`engines.duplex.text`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import MimiConfig, MoshiConfig, MoshiForConditionalGeneration

NUM_CODEBOOKS = 8  # per audio stream, as Moshi
TINY_TEXT_VOCAB = 4 + 95  # Moshi's four special ids, then printable ASCII (see text.py)


def tiny_config(*, context: int = 250) -> MoshiConfig:
    """A Moshi config with Moshi's structure and tiny sizes (CPU, random weights)."""
    mimi = MimiConfig(
        hidden_size=32, num_filters=4, num_residual_layers=1, codebook_size=64, codebook_dim=16,
        vector_quantization_hidden_dimension=16, num_quantizers=NUM_CODEBOOKS, num_semantic_quantizers=1,
        upsample_groups=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=250, use_cache=True,
    )
    depth = {
        "hidden_size": 32, "input_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "ffn_dim": 64, "vocab_size": TINY_TEXT_VOCAB, "audio_vocab_size": mimi.codebook_size,
        "num_codebooks": NUM_CODEBOOKS, "max_position_embeddings": NUM_CODEBOOKS + 1,
        "sliding_window": NUM_CODEBOOKS + 1,
    }
    return MoshiConfig(
        vocab_size=TINY_TEXT_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=128, num_codebooks=NUM_CODEBOOKS, max_position_embeddings=context, sliding_window=context,
        audio_encoder_config=mimi.to_dict(), depth_decoder_config=depth,
    )


def build_model(model: str, *, seed: int = 0, context: int = 250) -> tuple[Any, bool]:
    """Return ``(MoshiForConditionalGeneration in eval mode, is_tiny)``."""
    if model == "tiny":
        torch.manual_seed(seed)
        built = MoshiForConditionalGeneration(tiny_config(context=context))
        return built.eval(), True
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"duplex model must be 'tiny' or a local checkpoint directory (got {model!r})")
    return MoshiForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval(), False
