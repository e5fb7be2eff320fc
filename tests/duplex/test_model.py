"""The Moshi-family model pieces on tiny random weights: streaming Mimi, slot KV, frame step."""

from __future__ import annotations

import pytest
import torch

from engines.duplex.codec import MimiStreams
from engines.duplex.config import NUM_CODEBOOKS, build_model
from engines.duplex.lm import FrameLM
from engines.duplex.slot_kv import SlotKV
from engines.duplex.text import SpeechStretches, TextPieces

pytestmark = pytest.mark.system

FRAME = 1920


@pytest.fixture(scope="module")
def model() -> object:
    built, tiny = build_model("tiny", seed=0)
    assert tiny
    return built


def test_tiny_model_has_moshi_structure(model: object) -> None:
    cfg = model.config  # type: ignore[attr-defined]
    assert type(model).__name__ == "MoshiForConditionalGeneration"
    assert cfg.num_codebooks == NUM_CODEBOOKS
    assert len(model.embed_tokens) == 2 * NUM_CODEBOOKS  # type: ignore[attr-defined]  # model + user streams
    mimi = model.audio_encoder  # type: ignore[attr-defined]
    assert type(mimi).__name__ == "MimiModel"
    assert mimi.config.sampling_rate / mimi.config.frame_rate == FRAME  # 80 ms frames at 24 kHz


def test_streaming_encode_equals_whole_signal_encode(model: object) -> None:
    mimi = model.audio_encoder  # type: ignore[attr-defined]
    codec = MimiStreams(mimi, slots=6, num_codebooks=NUM_CODEBOOKS)
    audio = torch.randn(3, FRAME * 8, generator=torch.Generator().manual_seed(1)) * 0.2
    slots = torch.tensor([4, 0, 2])  # any slots, any order
    with torch.inference_mode():
        whole = mimi.encode(audio[:, None], num_quantizers=NUM_CODEBOOKS).audio_codes
        frames = [codec.encode(slots, audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(8)]
    assert torch.equal(torch.stack(frames, dim=-1), whole)


def test_streaming_decode_equals_whole_signal_decode(model: object) -> None:
    """Frame by frame, every slot's audio is the whole-signal decode's, from the first frame."""
    mimi = model.audio_encoder  # type: ignore[attr-defined]
    codec = MimiStreams(mimi, slots=4, num_codebooks=NUM_CODEBOOKS)
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, mimi.config.codebook_size, (2, NUM_CODEBOOKS, 10), generator=gen)
    slots = torch.tensor([3, 1])
    with torch.inference_mode():
        whole = mimi.decode(codes).audio_values[:, 0]
        # another session in slot 0 is mid-stream: its state must not leak into ours
        codec.decode(torch.tensor([0]), codes[:1, :, 0])
        streamed = torch.cat([codec.decode(slots, codes[:, :, i]) for i in range(10)], dim=-1)
    assert streamed.shape == whole.shape
    assert whole.std() > 0.1  # a varying signal, not a constant the check could pass vacuously
    assert torch.allclose(streamed, whole, atol=1e-4)


def test_slot_kv_masks_other_sessions_and_the_window() -> None:
    kv = SlotKV(layers=1, slots=3, kv_heads=1, head_dim=2, window=4)
    for _ in range(6):
        pos, mask = kv.begin(torch.tensor([0]), 1)
    assert pos.tolist() == [[5]]
    assert (mask[0, 0, 0] == 0).sum() == 4  # the last 4 positions of slot 0 only
    pos, mask = kv.begin(torch.tensor([0, 2]), 2)  # slot 2 is new: it sees its own 2 tokens, causally
    assert pos.tolist() == [[6, 7], [0, 1]]
    assert [(mask[1, 0, q] == 0).sum().item() for q in range(2)] == [1, 2]
    assert [(mask[0, 0, q] == 0).sum().item() for q in range(2)] == [4, 4]


def run_frames(
    lm: FrameLM, slots: list[int], codes: torch.Tensor, seeds: list[int]
) -> list[tuple[int, list[int]]]:
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    out = []
    with torch.inference_mode():
        for t in range(codes.shape[-1]):
            step = lm.step(torch.tensor(slots), codes[:, :, t], gens)
            out.append((int(step.text[0]), step.codes[0].tolist()))
    return out


def test_a_session_gets_the_same_stream_alone_or_batched(model: object) -> None:
    """State per session: batching with other sessions (other slots, other positions) changes nothing."""
    lm = FrameLM(model, slots=4, context=16, acoustic_delay=1)
    vocab = model.config.audio_vocab_size  # type: ignore[attr-defined]
    user = torch.randint(0, vocab, (3, NUM_CODEBOOKS, 12), generator=torch.Generator().manual_seed(3))
    alone = run_frames(lm, [1], user[:1], [7])
    lm.reset(1)
    # another session is already 5 frames in when ours starts in slot 1
    run_frames(lm, [3], user[2:3, :, :5], [9])
    batched = run_frames(lm, [1, 3, 0], user, [7, 9, 11])
    assert alone == batched
    assert len({tuple(c) for _, c in alone}) > 1  # the model does produce varying codes


def test_delay_pattern_first_frame_after_one_step(model: object) -> None:
    lm = FrameLM(model, slots=2, context=16, acoustic_delay=1)
    user = torch.zeros(1, NUM_CODEBOOKS, dtype=torch.long)
    gens = [torch.Generator().manual_seed(0)]
    with torch.inference_mode():
        first = lm.step(torch.tensor([0]), user, gens)
        second = lm.step(torch.tensor([0]), user, gens)
    assert first.ready.tolist() == [False] and second.ready.tolist() == [True]


def test_speech_stretches_from_the_text_stream() -> None:
    s = SpeechStretches(end_pad_frames=2, max_frames=7)
    tokens = [3, 3, 0, 10, 3, 11, 3, 3, 3, 12, 12, 12, 12, 12, 12, 12, 12]
    marks = []
    for t in tokens:
        step = s.push(t)
        marks.append("S" if step.started else ("E" if step.stopped else ("." if step.speaking else " ")))
    # starts at the end-of-padding token, ends after two pads in a row; a long one is cut at 7 frames
    assert "".join(marks) == "  S....E S.....ES"
    s2 = SpeechStretches(end_pad_frames=2, max_frames=2)
    assert [s2.push(t).cut for t in (10, 11)] == [False, True]
    assert s.count == 3 and s.close() and not s.close()


def test_tiny_text_pieces_are_printable() -> None:
    pieces = TextPieces()
    assert pieces.piece(4) == " " and pieces.piece(4 + 33) == "A"
    assert pieces.piece(3) == "" and not pieces.is_word(3) and not pieces.is_word(0)
