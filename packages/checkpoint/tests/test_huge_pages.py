"""Buffers on huge pages for O_DIRECT: aligned, zero-filled, writable, of the size asked for."""

import ctypes

import pytest

from smalti.checkpoint.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer


@pytest.mark.parametrize("nbytes", [1, 4096, 3 * HUGE_PAGE_BYTES + 5])
def test_a_buffer_starts_on_a_huge_page_and_holds_zeros(nbytes):
    view = huge_page_buffer(nbytes)
    assert len(view) == nbytes
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % HUGE_PAGE_BYTES == 0
    assert not any(view[:4096]) and not any(view[-16:])
    view[-1:] = b"\x07"
    assert view[-1] == 7


def test_a_size_of_zero_is_refused_by_name():
    with pytest.raises(ValueError, match="huge_page_buffer needs a positive size, got 0"):
        huge_page_buffer(0)
