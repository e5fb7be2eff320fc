"""The causal-LM responder on a tiny random Llama with a byte-level BPE built in code."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.speech.responder import CausalLmResponder, EchoResponder, Turn, make_responder
from engines.speech.stages import ResponderEngine
from runtime.engine import EdgeChunk
from runtime.payloads import TextDelta
from tests.engines_speech.conftest import run_engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny_lm")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["You said hello there. The quick brown fox jumps."] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=fast.vocab_size if len(fast) <= fast.vocab_size else len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_echo_responder_words() -> None:
    deltas = list(EchoResponder().respond(Turn(user_text="  hi   there ")))
    assert deltas == ["You", " said:", " hi", " there"]


def test_lm_prompt_uses_chat_template(tiny_lm_dir: Path) -> None:
    lm = make_responder(str(tiny_lm_dir))
    assert isinstance(lm, CausalLmResponder)
    assert make_responder(str(tiny_lm_dir)) is lm  # cached per process
    turn = Turn.from_params(
        "fox?", {"instructions": "Be brief.", "history": [{"role": "user", "text": "hello"}, {"role": "x"}]}
    )
    prompt = lm.tokenizer.decode(lm.prompt_ids(turn))
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>user\nfox?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_lm_streaming_equals_greedy_generate(tiny_lm_dir: Path) -> None:
    lm = make_responder(str(tiny_lm_dir))
    assert isinstance(lm, CausalLmResponder)
    turn = Turn(user_text="The quick brown fox", max_tokens=12)
    deltas = list(lm.respond(turn))
    ids = torch.tensor([lm.prompt_ids(turn)])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    expected = lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "".join(deltas) == expected
    assert len(deltas) > 1  # streamed, not one lump


def test_responder_engine_with_llm_option(tiny_lm_dir: Path) -> None:
    engine = ResponderEngine({"llm": str(tiny_lm_dir), "deltas_per_step": 2, "max_tokens": 8})
    engine.load()
    steps = run_engine(engine, {}, [EdgeChunk(items=[TextDelta("hello")], finished=True)])
    client = [p for _, o in steps for p in o.client]
    assert client and all(isinstance(p, TextDelta) for p in client)
    assert all(len(o.client) <= 2 for _, o in steps)
