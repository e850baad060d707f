"""A rank gives its heap's free pages back to the system after each round (glibc's malloc_trim): the
pages of blocks freed amid blocks still in use, which glibc keeps otherwise."""

import subprocess
import sys
import textwrap

import pytest

# In a process of its own (its heap is the test's alone): 64 MiB of small blocks, one block in every
# 64 KiB kept, the rest freed; resident memory read before and after release_free_heap.
FRAGMENTED_HEAP = textwrap.dedent("""
    import ctypes, os
    from fl_lightning.host_memory import release_free_heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def resident():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    freed, kept = [], []
    for group in range(1024):
        for _ in range(63):
            block = libc.malloc(1024)
            ctypes.memset(block, 1, 1024)  # touched: resident
            freed.append(block)
        kept.append(libc.malloc(1024))
    for block in freed:
        libc.free(block)
    before = resident()
    print(release_free_heap(), before - resident())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_free_pages_amid_blocks_in_use_go_back_to_the_system():
    completed = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    released, returned_bytes = completed.stdout.split()
    if released != "True":
        pytest.skip("this C library has no malloc_trim")
    # 63 MiB freed amid the kept blocks: all but the pages the kept blocks and the free lists touch.
    assert int(returned_bytes) > 48 * 2**20
