"""Tiny random causal LMs saved to a directory at test time, with a byte-level BPE tokenizer
built in code and a ChatML template (no download): Llama for the transformers responder,
Qwen3 for the vLLM engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["You said hello there. The quick brown fox jumps over the lazy dog."] * 20


def save_tokenizer(path: Path, vocab_size: int = 300) -> Any:
    """A byte-level BPE with ChatML specials, saved as a transformers fast tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(path)
    return fast


def save_tiny_llama(path: Path, *, hidden: int = 32, intermediate: int = 64, layers: int = 2) -> Path:
    """A tiny random ``LlamaForCausalLM`` (heads of 8 dimensions, 2 query heads per KV head);
    ``hidden=576, intermediate=1536`` gives SmolLM2-135M's matrix widths."""
    import torch
    import transformers

    fast = save_tokenizer(path)
    torch.manual_seed(0)
    heads = hidden // 8
    config = transformers.LlamaConfig(
        vocab_size=max(len(fast), fast.vocab_size),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_tiny_qwen3(path: Path, *, max_position_embeddings: int = 512) -> Path:
    """A tiny random ``Qwen3ForCausalLM`` (an architecture vLLM serves) with the tokenizer above."""
    import torch
    import transformers

    fast = save_tokenizer(path)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=max(len(fast), fast.vocab_size),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=True,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path
