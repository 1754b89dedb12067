"""Unit tests of the hierarchical cache's third tier (``minirad.kvcache.hicache_storage``).

Pages are keyed by chained page hashes (a page's hash covers its whole prefix) and stored one
safetensors file per page (SGLang's ``--hicache-storage-backend file``), written behind the
caller by one thread. Every damaged or foreign file must read as a miss with a notice, never as
an exception or as wrong KV, and a second instance on the same folder must find the first's
pages.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minirad.errors import InvalidArgumentError, InvalidKeyError
from minirad.kvcache.hicache_storage import (
    HiCacheFile,
    HiCacheMemoryStorage,
    HiCacheStorage,
    page_hashes,
)
from minirad.kvcache.kv_cache_manager import KVCacheManager

PS = 4  # page size of most tests


def h(i: int) -> str:
    """A valid page hash, distinct per ``i``."""
    return f"{i:064x}"


def page(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A small K/V page, different per seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(2, PS, 3, generator=g).to(dtype),
        "v": torch.randn(2, PS, 3, generator=g).to(dtype),
    }


def bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes: bitwise equality, NaNs and signed zeros included."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> bool:
    assert a is not None
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and bits(a[n]) == bits(b[n])
        for n in b
    )


@pytest.fixture
def store(tmp_path):
    s = HiCacheFile(tmp_path / "l3", fingerprint="model-a/bf16/ps4")
    yield s
    s.close()


def files(folder) -> list[str]:
    return sorted(os.listdir(folder))


# --- page hashes -----------------------------------------------------------------------------


def test_chain_shares_the_prefix_and_diverges_for_good():
    a = list(range(20))
    b = a[:9] + [999] + a[10:]  # differs in page 2 (tokens 8..11)
    ha, hb = page_hashes(a, PS), page_hashes(b, PS)
    assert len(ha) == len(hb) == 5
    assert ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))  # page 3, 4: same tokens
    assert page_hashes(a[4:8], PS) != [ha[1]]  # the same tokens behind another prefix
    assert all(len(x) == 64 and int(x, 16) >= 0 for x in ha)


def test_partial_last_page_is_not_hashed():
    assert len(page_hashes(list(range(11)), PS)) == 2
    assert page_hashes(list(range(3)), PS) == []
    assert page_hashes(list(range(11)), PS) == page_hashes(list(range(8)), PS)


def test_extra_key_changes_every_page():
    ids = list(range(16))
    plain, lora_a, lora_b = (page_hashes(ids, PS, k) for k in (None, "lora-a", "lora-b"))
    assert len({*plain, *lora_a, *lora_b}) == 12
    assert page_hashes(ids, PS, "") != plain  # an empty namespace is still a namespace
    assert page_hashes(ids, PS, "lora-a") == lora_a


def test_hashes_are_the_block_caches():
    """One hash space: the vLLM-style block cache names the same pages the same way."""
    ids = list(range(40, 63))
    mgr = KVCacheManager(num_blocks=8, block_size=PS)
    for key in (None, "salt"):
        assert page_hashes(ids, PS, key) == [x.hex() for x in mgr.block_hashes(ids, (), key)]


def test_numpy_and_tensor_ids_hash_like_ints():
    import numpy as np

    ids = list(range(12))
    assert page_hashes(np.array(ids, dtype=np.int64), PS) == page_hashes(ids, PS)
    assert page_hashes(torch.tensor(ids), PS) == page_hashes(ids, PS)


@given(
    ids=st.lists(st.integers(0, 2**40), max_size=40),
    cut_pages=st.integers(0, 10),
    ps=st.integers(1, 6),
    key=st.none() | st.text(max_size=3),
)
def test_chain_can_be_hashed_piece_by_piece(ids, cut_pages, ps, key):
    whole = page_hashes(ids, ps, key)
    cut = min(cut_pages * ps, len(ids) // ps * ps)
    head = page_hashes(ids[:cut], ps, key)
    parent = bytes.fromhex(head[-1]) if head else None
    tail = page_hashes(ids[cut:], ps, key if parent is None else None, parent)
    assert head + tail == whole
    if parent is not None:  # with a parent the key is already in the chain: not added again
        assert page_hashes(ids[cut:], ps, key, parent) == tail
    assert whole[: cut // ps] == head  # a prefix's pages are the prefix of the pages


def test_page_hashes_rejects_bad_arguments():
    for ps in (0, -1, 1.5, True, "4"):
        with pytest.raises(InvalidArgumentError):
            page_hashes([1, 2], ps)
    with pytest.raises(InvalidArgumentError):
        page_hashes([1, 2], 1, extra_key=3)
    for parent in (b"short", "ab" * 32, 7):
        with pytest.raises(InvalidArgumentError):
            page_hashes([1, 2], 1, parent=parent)
    for ids in ([1, -2], [1.0], ["a"], None):
        with pytest.raises(InvalidKeyError):
            page_hashes(ids, 1)


# --- round trip ------------------------------------------------------------------------------


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8]
DTYPES += [torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("write_behind", [True, False])
def test_round_trip_is_bitwise(tmp_path, write_behind):
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    pages = {h(i): page(i, dt) for i, dt in enumerate(DTYPES)}
    pages[h(100)] = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 5), "special": special}
    pages[h(101)] = {"t": torch.arange(24, dtype=torch.int32).reshape(4, 6).t()}  # not contiguous
    with HiCacheFile(tmp_path, "fp", write_behind=write_behind) as s:
        for key, p in pages.items():
            s.set(key, p)
        s.flush()
        for key, p in pages.items():
            assert same(s.get(key), p), key
        assert s.pages_written == len(pages)
        assert s.bytes_written == sum(os.path.getsize(s.path(k)) for k in pages)
        assert s.hits == len(pages) and s.misses == 0 and s.notices == []


def test_set_copies_the_callers_tensors(store):
    """With write-behind the caller reuses its host slots at once: the queued page must not."""
    p = page(1)
    want = {n: t.clone() for n, t in p.items()}
    store.set(h(1), p)
    p["k"].fill_(7.0)
    assert same(store.get(h(1)), want)
    store.flush()
    assert same(store.get(h(1)), want)
    store.get(h(1))["v"].fill_(9.0)  # nor may the caller change the stored page
    assert same(store.get(h(1)), want)


def test_empty_page_still_exists(tmp_path):
    """A cache without tensors stores empty pages: they must exist, and read back empty."""
    with HiCacheFile(tmp_path) as s:
        s.set(h(1), {})
        s.flush()
        assert s.exists([h(1)]) == 1
        assert os.path.exists(s.path(h(1)))
    with HiCacheFile(tmp_path) as again:
        assert again.get(h(1)) == {}


def test_missing_page_is_a_plain_miss(store):
    assert store.get(h(5)) is None
    assert store.misses == 1 and store.notices == []


def test_uppercase_hash_is_the_same_page(store):
    store.set(h(0xAB), page(1))
    assert same(store.get(h(0xAB).upper()), page(1))


# --- exists ----------------------------------------------------------------------------------


def test_exists_counts_leading_pages_only(store):
    for i in (0, 1, 3):
        store.set(h(i), page(i))
    store.flush()
    chain = [h(i) for i in range(4)]
    assert store.exists(chain) == 2
    assert store.exists(chain[2:]) == 0
    assert store.exists(chain[3:]) == 1
    assert store.exists([]) == 0
    os.mkdir(os.path.join(store.folder, h(9) + ".safetensors"))  # not a regular file
    assert store.exists([h(0), h(9)]) == 1


# --- write-behind ----------------------------------------------------------------------------


def test_write_behind_is_visible_before_flush_and_on_disk_after(store, monkeypatch):
    gate = threading.Event()
    real = store._write_file

    def held(path, data):
        assert gate.wait(30), "the test never opened the gate"
        real(path, data)

    monkeypatch.setattr(store, "_write_file", held)
    store.set(h(1), page(1))
    store.set(h(2), page(2))
    assert not os.path.exists(store.path(h(1)))  # still queued: the writer is held
    assert store.exists([h(1), h(2), h(3)]) == 2
    assert same(store.get(h(2)), page(2))
    gate.set()
    store.flush()
    assert os.path.exists(store.path(h(1))) and os.path.exists(store.path(h(2)))
    assert store.pages_written == 2
    assert [f for f in files(store.folder) if f.endswith(".tmp")] == []


def test_close_writes_everything_and_later_sets_write_through(tmp_path):
    s = HiCacheFile(tmp_path)
    for i in range(20):
        s.set(h(i), page(i))
    s.close()
    assert s._thread is None
    assert len(files(tmp_path)) == 20
    s.close()  # again: nothing
    s.set(h(99), page(99))  # after close: written at once
    assert os.path.exists(s.path(h(99)))
    assert same(s.get(h(99)), page(99))


def test_a_failed_write_is_a_notice_not_a_crash(store, monkeypatch, caplog):
    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_file", full_disk)
    with caplog.at_level(logging.WARNING, logger="minirad.kvcache.hicache_storage"):
        store.set(h(1), page(1))
        store.flush()
    assert store.get(h(1)) is None and store.exists([h(1)]) == 0
    assert store.pages_written == 0
    assert len(store.notices) == 1 and "No space left" in store.notices[0]
    assert "No space left" in caplog.text
    monkeypatch.undo()
    store.set(h(2), page(2))  # the writer thread survived
    store.flush()
    assert same(store.get(h(2)), page(2))


# --- sharing a folder ------------------------------------------------------------------------


def test_second_instance_finds_the_first_ones_pages(tmp_path):
    """A new engine after a restart (SGLang issue #27619) starts warm."""
    ids = list(range(100, 117))
    chain = page_hashes(ids, PS)
    first = HiCacheFile(tmp_path, "fp")
    for i, key in enumerate(chain[:3]):
        first.set(key, page(i))
    first.close()
    with HiCacheFile(str(tmp_path), "fp") as second:
        assert second.exists(page_hashes(ids, PS)) == 3
        assert same(second.get(chain[2]), page(2))
        assert second.notices == []


def test_same_page_set_twice_is_harmless(store):
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        store.set(h(1), page(1))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    store.set(h(1), page(1))  # on disk already: kept
    store.flush()
    assert store.pages_written == 1
    assert files(store.folder) == [h(1) + ".safetensors"]
    assert same(store.get(h(1)), page(1))


def test_two_instances_writing_the_same_pages(tmp_path):
    a, b = HiCacheFile(tmp_path, "fp"), HiCacheFile(tmp_path, "fp")
    for i in range(30):
        a.set(h(i), page(i))
        b.set(h(i), page(i))
    a.close()
    b.close()
    assert len(files(tmp_path)) == 30  # no temporary files left
    with HiCacheFile(tmp_path, "fp") as c:
        assert c.exists([h(i) for i in range(30)]) == 30
        assert all(same(c.get(h(i)), page(i)) for i in range(30))
        assert c.notices == []


# --- bad files -------------------------------------------------------------------------------


def _random_bytes(data: bytes) -> bytes:
    return os.urandom(len(data))


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _header_only(data: bytes) -> bytes:
    return data[: 8 + int.from_bytes(data[:8], "little")]


def _flipped_bit(data: bytes) -> bytes:
    return data[:-3] + bytes([data[-3] ^ 0x01]) + data[-2:]


def _empty(data: bytes) -> bytes:
    return b""


def _huge_header(data: bytes) -> bytes:
    return (2**62).to_bytes(8, "little") + data[8:]


@pytest.mark.parametrize(
    "damage", [_random_bytes, _truncated, _header_only, _flipped_bit, _empty, _huge_header]
)
def test_a_damaged_file_is_a_miss_with_a_notice(store, damage, caplog):
    for i in range(3):
        store.set(h(i), page(i))
    store.flush()
    path = store.path(h(1))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with caplog.at_level(logging.WARNING, logger="minirad.kvcache.hicache_storage"):
        assert store.get(h(1)) is None
    assert len(store.notices) == 1 and h(1)[:12] in store.notices[0]
    assert h(1)[:12] in caplog.text
    assert store.exists([h(0), h(1), h(2)]) == 1
    assert not os.path.exists(path)  # damaged: deleted
    assert store.get(h(1)) is None and len(store.notices) == 1
    store.set(h(1), page(1))  # it can be stored again
    store.flush()
    assert store.exists([h(0), h(1), h(2)]) == 3
    assert same(store.get(h(1)), page(1))


def test_another_fingerprint_is_a_miss_and_its_file_is_kept(tmp_path):
    with HiCacheFile(tmp_path, "model-a") as a:
        a.set(h(0), page(0))
        a.set(h(1), page(1))
    b = HiCacheFile(tmp_path, "model-b", write_behind=False)
    assert b.exists([h(0), h(1)]) == 2  # by name only: exists does not open files
    assert b.get(h(0)) is None
    assert len(b.notices) == 1 and "model-a" in b.notices[0]
    assert b.exists([h(0), h(1)]) == 0
    assert b.get(h(0)) is None and len(b.notices) == 1  # the same file: no second notice
    assert os.path.exists(b.path(h(0)))  # another model's page: left alone
    b.set(h(0), page(5))  # b's own page replaces it
    assert same(b.get(h(0)), page(5)) and b.exists([h(0)]) == 1
    with HiCacheFile(tmp_path, "model-a") as a:
        assert same(a.get(h(1)), page(1))
        assert a.get(h(0)) is None and "model-b" in a.notices[0]


def test_another_pages_file_under_this_name_is_a_miss(store):
    store.set(h(1), page(1))
    store.flush()
    os.replace(store.path(h(1)), store.path(h(2)))
    assert store.get(h(2)) is None
    assert len(store.notices) == 1 and store.exists([h(2)]) == 0


def test_a_foreign_safetensors_file_is_a_miss(store):
    from safetensors.torch import save_file

    save_file({"k": torch.zeros(2)}, store.path(h(3)))  # no minirad metadata
    assert store.get(h(3)) is None
    assert len(store.notices) == 1 and store.exists([h(3)]) == 0


def test_a_newer_format_version_is_ignored_not_deleted(store, monkeypatch):
    import minirad.kvcache.hicache_storage as mod

    monkeypatch.setattr(mod, "FORMAT_VERSION", "999")
    store.set(h(1), page(1))
    store.flush()
    monkeypatch.undo()
    assert store.get(h(1)) is None
    assert "999" in store.notices[0]
    assert os.path.exists(store.path(h(1)))


# --- the memory backend ----------------------------------------------------------------------


def test_memory_storage_drops_the_least_recently_used():
    s = HiCacheMemoryStorage(capacity_pages=3)
    for i in range(3):
        s.set(h(i), page(i))
    assert s.get(h(0)) is not None  # 0 is now the most recent; 1 the least
    assert s.exists([h(2)]) == 1  # a probe does not refresh
    s.set(h(3), page(3))
    assert s.exists([h(1)]) == 0 and s.get(h(1)) is None
    assert s.exists([h(0)]) == 1 and s.exists([h(2)]) == 1
    s.set(h(4), page(4))
    assert s.get(h(2)) is None and same(s.get(h(0)), page(0))
    assert len(s) == 3 and s.evictions == 2
    assert s.pages_written == 5 and s.misses == 2


def test_memory_storage_is_a_storage_and_copies():
    s = HiCacheMemoryStorage()
    assert isinstance(s, HiCacheStorage)
    p = page(1)
    s.set(h(1), p)
    s.set(h(1), page(2))  # already stored: kept
    p["k"].zero_()
    s.get(h(1))["v"].zero_()
    assert same(s.get(h(1)), page(1))
    assert s.exists([h(1), h(2)]) == 1 and s.pages_written == 1
    assert s.bytes_written == 2 * 2 * PS * 3 * 4
    s.set(h(2), {})
    assert s.get(h(2)) == {}
    s.flush()
    s.close()


# --- arguments -------------------------------------------------------------------------------


def test_file_storage_rejects_bad_arguments(tmp_path):
    assert isinstance(HiCacheFile(tmp_path, write_behind=False), HiCacheStorage)
    for folder in (None, 3, b"/tmp/x", ""):
        with pytest.raises(InvalidArgumentError):
            HiCacheFile(folder)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(InvalidArgumentError):
        HiCacheFile(a_file)
    with pytest.raises(InvalidArgumentError):
        HiCacheFile(tmp_path, fingerprint=1)
    with pytest.raises(InvalidArgumentError):
        HiCacheFile(tmp_path, write_behind="yes")


@pytest.mark.parametrize("make", [HiCacheMemoryStorage, "file"])
def test_storage_calls_reject_bad_arguments(tmp_path, make):
    s = HiCacheFile(tmp_path, write_behind=False) if make == "file" else make()
    bad_hashes = [h(1)[:-1], "g" * 64, b"0" * 64, 5, None, h(1) + "0"]
    for bad in bad_hashes:
        with pytest.raises(InvalidArgumentError):
            s.get(bad)
        with pytest.raises(InvalidArgumentError):
            s.set(bad, {})
        with pytest.raises(InvalidArgumentError):
            s.exists([h(0), bad])
    with pytest.raises(InvalidArgumentError):
        s.exists(h(1))  # one string, not a list of them
    bad_pages = [None, [torch.zeros(1)], {1: torch.zeros(1)}, {"k": [1.0]}, {"": torch.zeros(1)}]
    bad_pages += [{"__metadata__": torch.zeros(1)}, {"k": torch.zeros(2).to_sparse()}]
    for bad in bad_pages:
        with pytest.raises(InvalidArgumentError):
            s.set(h(1), bad)
    assert s.exists([h(1)]) == 0 and s.pages_written == 0
    for cap in (0, -1, 2.0, True):
        with pytest.raises(InvalidArgumentError):
            HiCacheMemoryStorage(cap)
