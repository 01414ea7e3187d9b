"""The free block queue: an intrusive doubly-linked list with O(1) operations."""

from __future__ import annotations

import pytest

from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_initial_order_is_block_order() -> None:
    """A new queue hands blocks out in id order."""
    _, queue = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert len(queue) == 5


def test_popleft_and_popleft_n() -> None:
    """popleft takes the head; popleft_n takes the first n, head first, and unlinks them."""
    _, queue = make_queue(6)
    assert queue.popleft().block_id == 0
    taken = queue.popleft_n(3)
    assert [b.block_id for b in taken] == [1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
    assert queue.block_ids() == [4, 5]
    assert queue.num_free_blocks == 2
    assert queue.popleft_n(0) == []


def test_popleft_n_all_then_empty() -> None:
    """Taking every block leaves an empty queue; popping more raises."""
    _, queue = make_queue(3)
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 1, 2]
    assert queue.block_ids() == []
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft_n(1)


def test_remove_from_middle() -> None:
    """remove unlinks a block from the middle in O(1), keeping the rest in order."""
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    assert queue.num_free_blocks == 4


def test_append_and_append_n_go_to_tail() -> None:
    """append and append_n put blocks at the tail in the order given."""
    _, queue = make_queue(6)
    taken = queue.popleft_n(4)
    queue.append(taken[2])
    queue.append_n([taken[1], taken[3]])
    assert queue.block_ids() == [4, 5, 2, 1, 3]
    queue.append_n([])
    assert queue.num_free_blocks == 5


def test_prepend_n_keeps_order_at_head() -> None:
    """prepend_n puts blocks at the head; the first one given becomes the head."""
    _, queue = make_queue(5)
    taken = queue.popleft_n(3)
    queue.prepend_n([taken[2], taken[0]])
    assert queue.block_ids() == [2, 0, 3, 4]
    assert queue.popleft().block_id == 2


def test_prepend_and_append_on_empty_queue() -> None:
    """Both ends work on an empty queue."""
    blocks, queue = make_queue(3)
    queue.popleft_n(3)
    queue.prepend_n([blocks[1]])
    queue.append(blocks[2])
    queue.prepend_n([blocks[0]])
    assert queue.block_ids() == [0, 1, 2]
    assert len(queue) == 3
