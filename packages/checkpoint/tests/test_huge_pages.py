"""Buffers on huge pages for O_DIRECT: aligned, zero-filled, writable, of the size asked for."""

import ctypes

import pytest

from smalti.checkpoint.io.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer


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


def _huge_kib_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_the_buffer_is_backed_by_huge_pages_where_the_kernel_offers_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this system")
    if "[never]" in setting:
        pytest.skip("transparent huge pages are switched off")
    view = huge_page_buffer(4 * HUGE_PAGE_BYTES)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert _huge_kib_of_mapping(address) >= 2048
