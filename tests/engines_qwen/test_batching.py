"""Continuous batching in the Qwen3-Omni engines: each request's outputs batched are exactly its
outputs alone (greedy, same seed), bit for bit: thinker tokens, talker codes, code2wav samples;
also when requests join late or are cancelled mid-batch."""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from engines.qwen3_omni.batched import talker_prefill_hidden, thinker_prefill_logits
from engines.qwen3_omni.code2wav_rows import decode_windows, fixed_kernels, sine_in_place
from engines.rowbatch import RowExact, RowKV, SegmentKV, row_linear, rows_attention
from runtime.engine import EdgeChunk, EngineRequest, StepInput
from runtime.payloads import AudioChunk, CodecCodes
from tests.engines_qwen.batch_driver import Member, run_batched
from tests.engines_qwen.driver import Engines, Run, run_pipeline

# Layer: builds the tiny Qwen3-Omni model.
pytestmark = pytest.mark.system

TOKENS, FRAMES = 14, 34  # two code2wav chunks (4 + 25) and a finished remainder


def params(i: int, tokens: int = TOKENS, frames: int = FRAMES) -> dict[str, object]:
    """Different prompts (different prompt lengths, so caches of different lengths batch)."""
    return {
        "text": "Hi" + " there" * i + f", request {i}?",
        "greedy": True,
        "seed": 0,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "max_frames": frames,
        "min_frames": frames,
    }


@pytest.fixture(scope="module")
def alone(engines: Engines) -> dict[int, Run]:
    return {i: run_pipeline(engines, params(i), request_id=f"a{i}") for i in range(6)}


def assert_same(batched: Run, single: Run) -> None:
    assert batched.tokens == single.tokens
    assert batched.text == single.text
    np.testing.assert_array_equal(batched.code_matrix, single.code_matrix)
    assert batched.samples.dtype == single.samples.dtype == np.float32
    assert batched.samples.tobytes() == single.samples.tobytes()  # bitwise, not approximately


def test_batched_outputs_are_bitwise_the_outputs_alone(engines: Engines, alone: dict[int, Run]) -> None:
    packed = engines.thinker.stats["packed_prefills"], engines.talker.packed_prefills
    members = run_batched(engines, [Member(params(i)) for i in range(6)])
    assert max(max(m.batch_sizes) for m in members) == 6  # the thinker really stepped them together
    # ... and prefilled the six prompts (different lengths) in one packed forward, the talker too
    assert engines.thinker.stats["packed_prefills"] - packed[0] == 6
    assert engines.talker.packed_prefills - packed[1] == 6
    for i, m in enumerate(members):
        assert m.run.code_matrix.shape == (FRAMES, 16)
        assert m.run.samples.size == FRAMES * 1920 - 555
        assert_same(m.run, alone[i])


def test_joining_and_cancelled_requests_leave_the_others_unchanged(
    engines: Engines, alone: dict[int, Run]
) -> None:
    packed = engines.thinker.stats["packed_prefills"]
    members = run_batched(
        engines,
        [
            Member(params(0)),
            Member(params(1), join_at=3),  # joins while 0 decodes
            Member(params(2), cancel_at=6),  # cancelled mid-batch
            Member(params(3), join_at=9, cancel_at=20),
            Member(params(4), join_at=9),  # joins with 3: one packed prefill beside the decodes
        ],
    )
    for i in (0, 1, 4):
        assert_same(members[i].run, alone[i])
    assert engines.thinker.stats["packed_prefills"] - packed >= 2
    cancelled = members[2].run
    assert 0 < len(cancelled.tokens) < TOKENS
    assert cancelled.tokens == alone[2].tokens[: len(cancelled.tokens)]  # same prefix until cancelled
    assert max(members[1].batch_sizes) >= 3


@pytest.fixture(params=[(1, None), (2, None), (1, 1.0), (2, 1.0)], ids=lambda p: f"threads{p[0]}-gamma{p[1]}")
def code2wav_case(request: pytest.FixtureRequest, engines: Engines) -> Iterator[torch.nn.Module]:
    """The tiny code2wav at 1 or 2 threads, with its random ConvNeXt layer scale (``gamma``,
    1e-6: it rounds a difference in the per-position products away) or a copy with the scale at
    1, so the ConvNeXt blocks' products reach the samples."""
    threads, gamma = request.param
    code2wav = engines.code2wav.loaded.model.code2wav
    if gamma is not None:
        code2wav = copy.deepcopy(code2wav)
        for module in code2wav.modules():
            if isinstance(module, qm.Qwen3OmniMoeConvNeXtBlock):
                module.gamma.data.fill_(gamma)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield code2wav
    finally:
        torch.set_num_threads(before)


def test_code2wav_windows_of_any_lengths_decode_in_one_call_bitwise(code2wav_case: torch.nn.Module) -> None:
    """Windows of different lengths (a first chunk, steady chunks with their context, a request's
    last 1-3 frames) decode together, padded in one call; each is bit for bit the window decoded
    alone, and within float rounding of the model's own forward (whose kernels vary with shape).
    Short windows beside short ones too (4 and 5 frames: an im2col GEMM over 4 or 5 columns gave
    other bits), every product's row count differing between alone and together."""
    code2wav = code2wav_case
    rng = np.random.default_rng(3)
    lengths = [4, 5, 29, 29, 54, 16, 4, 1, 2, 3, 4, 4, 26, 50, 4, 8]
    windows = [torch.from_numpy(rng.integers(0, 128, size=(16, n))) for n in lengths]
    with torch.inference_mode():
        alone = [decode_windows(code2wav, [w])[0] for w in windows]
        groups = [slice(0, 7), slice(7, 10), slice(0, 16), slice(3, 16, 4), slice(0, 2), slice(6, 8)]
        for rows in [*groups, slice(9, 12)]:
            together = decode_windows(code2wav, windows[rows])
            for single, got in zip(alone[rows], together, strict=True):
                assert got.numpy().tobytes() == single.numpy().tobytes()
        for window, single in zip(windows, alone, strict=True):
            reference = code2wav(window[None])[0, 0]
            assert single.shape == reference.shape == (window.shape[1] * 1920 - 555,)
            peak = float(reference.abs().max())
            np.testing.assert_allclose(single.numpy(), reference.numpy(), rtol=0, atol=1e-5 * peak)


def test_code2wav_sine_bits_depend_on_the_sample_only() -> None:
    """The tail's sine (NumPy's, in place): a sample's bits are the same at any offset in an array
    of any length, contiguous or a strided view with left padding, as the batched decode needs;
    within 1e-7 of the exact sine."""
    rng = np.random.default_rng(5)
    values = (rng.standard_normal(9000) * 3).astype(np.float32)
    reference = torch.from_numpy(values.copy())
    sine_in_place(reference)
    for n in [*range(1, 40), 63, 64, 65, 7125]:
        for offset in range(17):
            row = torch.from_numpy(values[offset : offset + n].copy())
            buffer = torch.zeros(3, 1, 5 + n)
            buffer[1, 0, 5:] = row
            for got in (sine_in_place(row), sine_in_place(buffer[:, :, 5:])[1, 0]):
                assert got.numpy().tobytes() == reference[offset : offset + n].numpy().tobytes()
    exact = np.sin(values.astype(np.float64))
    assert np.abs(reference.numpy() - exact).max() < 1e-7


def test_code2wav_without_the_fixed_kernels_decodes_each_window_with_the_model(engines: Engines) -> None:
    """In another dtype (or on another device) the batch-invariant kernels were never measured, so
    each window runs the model's own forward: its samples are the model's, bit for bit."""
    code2wav = copy.deepcopy(engines.code2wav.loaded.model.code2wav).to(torch.float64)
    assert not fixed_kernels(code2wav) and fixed_kernels(engines.code2wav.loaded.model.code2wav)
    rng = np.random.default_rng(7)
    windows = [torch.from_numpy(rng.integers(0, 128, size=(16, n))) for n in (4, 29, 1)]
    with torch.inference_mode():
        for window, got in zip(windows, decode_windows(code2wav, windows), strict=True):
            assert got.dtype == torch.float64
            assert got.numpy().tobytes() == code2wav(window[None])[0, 0].numpy().tobytes()


def test_code2wav_rows_joining_and_leaving_keep_their_samples(engines: Engines) -> None:
    """Three steps of the engine, requests joining (a first chunk beside others' second chunks)
    and leaving (cancelled: absent from the next step): every chunk's samples are bit for bit
    those of its request stepped alone."""
    c2w = engines.code2wav
    rng = np.random.default_rng(6)
    frames = {r: [CodecCodes(rng.integers(0, 128, size=(1, 16))) for _ in range(4 + 25 + 25)] for r in "abcd"}

    def chunk(r: str, index: int) -> EdgeChunk:
        start, stop = [(0, 4), (4, 29), (29, 54)][index]
        context = frames[r][max(0, start - 25) : start]
        return EdgeChunk(items=frames[r][start:stop], context=context, index=index)

    steps = [["a", "b", "c"], ["a", "b", "d"], ["a", "d"]]  # d joins at step 1, c and b leave
    first_step = {r: min(i for i, live in enumerate(steps) if r in live) for r in "abcd"}

    def decode(live: list[str], step: int, states: dict[str, object]) -> dict[str, bytes]:
        batch = [StepInput(state=states[r], chunks=[chunk(r, step - first_step[r])]) for r in live]
        out = {}
        for r, o in zip(live, c2w.step(batch), strict=True):
            audio = o.client[0]
            assert isinstance(audio, AudioChunk)
            out[r] = audio.samples.tobytes()
        return out

    together: dict[str, object] = {}
    batched, shapes = [], []
    for step, live in enumerate(steps):
        together.update({r: c2w.start(EngineRequest(f"t-{r}", {})) for r in live if r not in together})
        batched.append(decode(live, step, together))
        shapes.append(c2w.last_batch_shapes)
    # rows × padded window per forward: first chunks together, then d's first chunk beside the
    # second chunks of a and b, then d's second and a's third (too many frames for one forward)
    assert shapes == [[(3, 16, 4)], [(1, 16, 4), (2, 16, 29)], [(1, 16, 29), (1, 16, 50)]]
    for r in "abcd":
        state = c2w.start(EngineRequest(f"alone-{r}", {}))
        for step, live in enumerate(steps):
            if r in live:
                assert decode([r], step, {r: state})[r] == batched[step][r], (r, step)


def test_code2wav_engine_steps_requests_of_different_chunk_lengths_together(engines: Engines) -> None:
    c2w = engines.code2wav
    rng = np.random.default_rng(4)
    sizes = [4, 5, 5, 4]  # close lengths: one padded call (padding within PAD_SLACK)

    def chunk(n: int) -> EdgeChunk:
        return EdgeChunk(items=[CodecCodes(rng.integers(0, 128, size=(1, 16))) for _ in range(n)])

    chunks = [chunk(n) for n in sizes]
    alone = []
    for i, ch in enumerate(chunks):
        state = c2w.start(EngineRequest(f"alone{i}", {}))
        alone.append(c2w.step([StepInput(state=state, chunks=[ch])])[0].client[0])
    states = [c2w.start(EngineRequest(f"together{i}", {})) for i in range(len(sizes))]
    outs = c2w.step([StepInput(state=s, chunks=[ch]) for s, ch in zip(states, chunks, strict=True)])
    assert c2w.last_batch_shapes == [(4, 16, 5)]
    for single, out in zip(alone, outs, strict=True):
        got = out.client[0]
        assert isinstance(single, AudioChunk) and isinstance(got, AudioChunk)
        assert got.samples.tobytes() == single.samples.tobytes()
    # A 4-frame first chunk is not padded to a 54-frame window: two calls.
    states = [c2w.start(EngineRequest(f"mixed{i}", {})) for i in range(2)]
    c2w.step([StepInput(state=states[0], chunks=[chunk(4)]), StepInput(state=states[1], chunks=[chunk(54)])])
    assert c2w.last_batch_shapes == [(1, 16, 4), (1, 16, 54)]


def test_code_predictor_rows_in_one_batched_cache_keep_their_bits(engines: Engines) -> None:
    """The talker's code predictor steps every frame's rows on one batched cache (fresh per frame,
    so all rows share positions and lengths) with plain batched attention: every pass's logits of
    every row are bit for bit the row run alone, not only the greedy codes they lead to."""
    loaded = engines.talker.loaded
    predictor = loaded.model.talker.code_predictor
    gen = torch.Generator().manual_seed(5)
    rows = 8
    prefix = torch.randn(rows, 2, loaded.talker_hidden, generator=gen)
    codes = torch.randint(0, loaded.codebook_size, (rows, loaded.num_code_groups), generator=gen)

    def logits(select: slice, exact: bool) -> torch.Tensor:
        cache = loaded.predictor_cache()
        passes = []
        with torch.inference_mode(), RowExact() if exact else contextlib.nullcontext():
            out = predictor(inputs_embeds=prefix[select], cache=cache, use_cache=True)
            passes.append(out.logits[:, -1].clone())
            for g in range(1, loaded.num_code_groups - 1):
                step = codes[select, g : g + 1]
                out = predictor(input_ids=step, generation_steps=g, cache=cache, use_cache=True)
                passes.append(out.logits[:, -1].clone())
        return torch.stack(passes, dim=1)

    together = logits(slice(0, rows), exact=True)
    for b in range(rows):
        alone = logits(slice(b, b + 1), exact=False)
        assert together[b : b + 1].numpy().tobytes() == alone.numpy().tobytes()


@pytest.mark.parametrize(
    ("outputs", "inputs", "bias"),
    [
        (64, 64, False),
        (128, 64, False),
        (64, 128, False),
        (4, 64, False),
        (1, 64, False),
        (128, 64, True),
        (4096, 64, False),
    ],
)
def test_row_linear_computes_every_row_as_the_row_alone(outputs: int, inputs: int, bias: bool) -> None:
    """One batched product over a stride-0 view of the weight (a weight under 400 elements
    padded with zero rows: a MoE router's 4 experts), a product with a bias, and the row-by-row
    fallback (one output): every row's bits are F.linear's on that row alone, for [B, K],
    [B, 1, K] and [B, T, K] rows (T tokens each: the code predictor's 2-position first pass,
    code2wav's windows), with and without a module keeping the prepared weight."""
    gen = torch.Generator().manual_seed(outputs + inputs)
    weight = torch.randn(outputs, inputs, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    owner = torch.nn.Module()
    for rows, tokens in ((2, 1), (3, 1), (8, 1), (16, 1), (20, 1), (5, 1), (8, 2), (4, 29), (3, 75)):
        x = torch.randn(rows, tokens, inputs, generator=gen)
        alone = torch.cat([torch.nn.functional.linear(x[i : i + 1].clone(), weight, b) for i in range(rows)])
        for shaped, expect in ((x, alone), (x[:, 0], alone[:, 0])) if tokens == 1 else ((x, alone),):
            for kept in (None, owner):
                got = row_linear(shaped, weight, b, owner=kept)
                assert got.shape == expect.shape
                assert got.numpy().tobytes() == expect.numpy().tobytes()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("outputs", "inputs"), [(256, 64), (64, 256), (128, 64), (400, 4), (50, 8), (1536, 576)]
)
def test_row_linear_keeps_a_rows_bits_for_any_row_count(threads: int, outputs: int, inputs: int) -> None:
    """A plain GEMM gives a row other bits at some row counts than at others (which counts depends
    on the widths, the threads and the CPU); row_linear gives every row the same bits at every
    count: what code2wav's per-position products and the responder's decode rely on."""
    gen = torch.Generator().manual_seed(outputs * inputs)
    weight = torch.randn(outputs, inputs, generator=gen)
    bias = torch.randn(outputs, generator=gen)
    x = torch.randn(3000, inputs, generator=gen)
    owner = torch.nn.Module()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        first = F.linear(x[:1].clone(), weight, bias)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 17, 33, 300, 3000):
            got = row_linear(x[:rows], weight, bias, owner=owner)
            assert got[:1].numpy().tobytes() == first.numpy().tobytes(), rows
            last = F.linear(x[rows - 1 : rows].clone(), weight, bias)
            assert got[rows - 1 :].numpy().tobytes() == last.numpy().tobytes(), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_prefill_keeps_every_prompts_bits_at_any_lengths(engines: Engines, threads: int) -> None:
    """Prompts of 4 to 13 tokens prefilled in one packed forward (thinker and talker): each
    prompt's logits / last hidden state are bit for bit those of its prompt prefilled alone (one
    plain forward over its own tokens), although a GEMM over the packed tokens has another row
    count than over one prompt's (at two threads 5-7 and 9-11 rows give other bits than 4, 8 or
    12+ on this host): the products run once per prompt."""
    loaded = engines.thinker.loaded
    thinker, talker = loaded.model.thinker, loaded.model.talker
    gen = torch.Generator().manual_seed(9)
    lengths = [5, 6, 7, 9, 11, 4, 13, 8]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for model, cache, packed in (
                (thinker.model.language_model, loaded.thinker_cache, thinker_prefill_logits),
                (talker.model, loaded.talker_cache, talker_prefill_hidden),
            ):
                embeds = [torch.randn(1, n, model.config.hidden_size, generator=gen) for n in lengths]
                alone = []
                for e in embeds:
                    positions = torch.arange(e.shape[1]).view(1, 1, -1).expand(4, 1, -1)
                    out = model(inputs_embeds=e, position_ids=positions, cache=cache(), use_cache=True)
                    last = out.last_hidden_state[:, -1]
                    alone.append(thinker.lm_head(last).reshape(-1) if model is not talker.model else last)
                together = packed(loaded, embeds, [cache() for _ in embeds])
                for n, single, got in zip(lengths, alone, together, strict=True):
                    assert got.reshape(-1).numpy().tobytes() == single.reshape(-1).numpy().tobytes(), n
    finally:
        torch.set_num_threads(before)


def test_requests_whose_caches_have_the_same_length_are_bitwise_the_outputs_alone(engines: Engines) -> None:
    """Prompts of the same length (requests 1-4; 0 is longer) step with caches of equal lengths,
    so their rows' attention runs as one batched ``sdpa`` (the decode rows and the packed
    prefills): every request's tokens, codes and samples are still bit for bit its run alone."""

    def same_length(i: int) -> dict[str, object]:
        return {
            **params(0),
            "text": f"Tell me about request {i}." if i else "A longer prompt than the others.",
        }

    members = run_batched(engines, [Member(same_length(i)) for i in range(5)])
    assert max(max(m.batch_sizes) for m in members) == 5
    for i, m in enumerate(members):
        assert_same(m.run, run_pipeline(engines, same_length(i), request_id=f"s{i}"))


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_attention_groups_rows_of_equal_length_bitwise(engines: Engines, threads: int) -> None:
    """rows_attention over decode rows (RowKV) and packed prompts (SegmentKV) of mixed lengths:
    rows of equal lengths run in one batched sdpa (on one thread; at two, where a lone row's keys
    are split across the threads, each row alone), and every row's output is bit for bit its own
    sdpa call alone."""
    attention = engines.thinker.loaded.model.thinker.model.language_model.layers[0].self_attn
    heads, kv_heads, dim = 4, 2, attention.head_dim
    gen = torch.Generator().manual_seed(11)
    kwargs = {"scaling": attention.scaling, "dropout": 0.0}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            lengths = [37, 37, 12, 37, 12, 90]
            keys = RowKV(torch.randn(1, kv_heads, n, dim, generator=gen) for n in lengths)
            values = RowKV(torch.randn(1, kv_heads, n, dim, generator=gen) for n in lengths)
            query = torch.randn(len(lengths), heads, 1, dim, generator=gen)
            got, _ = rows_attention(attention, query, keys, values, None, **kwargs)
            for i in range(len(lengths)):
                alone = sdpa_attention_forward(
                    attention, query[i : i + 1].clone(), keys[i], values[i], None, **kwargs
                )[0]
                assert got[i : i + 1].numpy().tobytes() == alone.numpy().tobytes(), i
            prompts = [9, 14, 9, 9, 5]
            bounds = list(itertools.pairwise(itertools.accumulate(prompts, initial=0)))
            seg_keys, seg_values = SegmentKV(bounds), SegmentKV(bounds)
            seg_keys.extend(torch.randn(1, kv_heads, n, dim, generator=gen) for n in prompts)
            seg_values.extend(torch.randn(1, kv_heads, n, dim, generator=gen) for n in prompts)
            query = torch.randn(1, heads, sum(prompts), dim, generator=gen)
            got, _ = rows_attention(attention, query, seg_keys, seg_values, None, **kwargs)
            for i, (a, b) in enumerate(bounds):
                q = query[:, :, a:b].clone()
                alone = sdpa_attention_forward(attention, q, seg_keys[i], seg_values[i], None, **kwargs)[0]
                assert got[:, a:b].numpy().tobytes() == alone.numpy().tobytes(), i
    finally:
        torch.set_num_threads(before)
