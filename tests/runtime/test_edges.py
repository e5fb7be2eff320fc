from __future__ import annotations

import pytest

from runtime.edges import AsyncChunker, FullCollector, make_collector
from runtime.spec import ChunkPolicy

pytestmark = pytest.mark.unit


def run(chunker: AsyncChunker[int], n: int, step: int = 1) -> list:
    chunks = []
    for start in range(0, n, step):
        chunks += chunker.extend(list(range(start, min(n, start + step))))
    chunks.append(chunker.finish())
    return chunks


def test_qwen_recipe_4_25_25() -> None:
    chunks = run(AsyncChunker(ChunkPolicy(first=4, steady=25, left_context=25)), 80)
    assert [len(c.items) for c in chunks] == [4, 25, 25, 25, 1]
    assert [len(c.context) for c in chunks] == [0, 4, 25, 25, 25]
    assert [c.finished for c in chunks] == [False, False, False, False, True]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert chunks[1].context == [0, 1, 2, 3] and chunks[1].items == list(range(4, 29))
    assert chunks[2].context == list(range(4, 29))  # the previous chunk is the left context
    assert chunks[4].items == [79] and chunks[4].context == list(range(54, 79))
    flat = [x for c in chunks for x in c.items]
    assert flat == list(range(80))


def test_release_each_item_once_after_its_last_use() -> None:
    chunks = run(AsyncChunker(ChunkPolicy(first=4, steady=25, left_context=25)), 80, step=7)
    released = [x for c in chunks for x in c.release]
    assert sorted(released) == list(range(80))
    for i, chunk in enumerate(chunks):
        later = {x for c in chunks[i + 1:] for x in (*c.items, *c.context)}
        assert not later & set(chunk.release), f"chunk {i} released an item still needed"


def test_finish_with_nothing_pending_sends_empty_finished_chunk() -> None:
    chunker: AsyncChunker[int] = AsyncChunker(ChunkPolicy(first=2, steady=2, left_context=1))
    assert [c.items for c in chunker.extend([1, 2, 3, 4])] == [[1, 2], [3, 4]]
    last = chunker.finish()
    assert last.items == [] and last.finished and last.context == [4] and last.release == [4]
    with pytest.raises(RuntimeError):
        chunker.push(5)


def test_one_by_one_without_context() -> None:
    chunks = run(AsyncChunker(ChunkPolicy()), 3)
    assert [(c.items, c.context, c.finished) for c in chunks] == [([0], [], False), ([1], [], False),
                                                                  ([2], [], False), ([], [], True)]
    assert [c.release for c in chunks] == [[0], [1], [2], []]


def test_context_larger_than_history_and_bulk_extend() -> None:
    chunker: AsyncChunker[int] = AsyncChunker(ChunkPolicy(first=1, steady=3, left_context=10))
    chunks = chunker.extend(list(range(8)))  # one extend may produce several chunks
    assert [c.items for c in chunks] == [[0], [1, 2, 3], [4, 5, 6]]
    assert [c.context for c in chunks] == [[], [0], [0, 1, 2, 3]]
    assert chunker.pending == 1


def test_full_collector() -> None:
    full = make_collector("full", ChunkPolicy())
    assert isinstance(full, FullCollector)
    assert full.extend([1, 2]) == [] and full.push(3) == []
    chunk = full.finish()
    assert chunk.items == [1, 2, 3] and chunk.finished and chunk.release == [1, 2, 3] and chunk.index == 0
    with pytest.raises(ValueError):
        make_collector("sometimes", ChunkPolicy())
