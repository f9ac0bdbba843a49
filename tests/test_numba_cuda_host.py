"""The numba_cuda host side without a GPU: libcuda and builds stood in for, to check what
happens around a launch (contexts popped on errors, errors named), the compile cache's
locking, and the torch scratch buffer under threads."""
from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from dataclasses import replace

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0"):
    pytest.skip("the raw launch path is not taken under the CUDA simulator",
                allow_module_level=True)

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")

from flashcore.backends.numba_cuda import driver

ILLEGAL_ADDRESS = 700


class FakeLibcuda:
    """libcuda's functions that a launch calls, recording the context stack."""

    def __init__(self, current=1, launch_err=0):
        self.stack = [current]
        self.launch_err = launch_err

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.stack[-1]
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.stack.append(ctx)
        return 0

    def cuCtxPopCurrent_v2(self, ref):
        ref._obj.value = self.stack.pop()
        return 0

    def cuLaunchKernel(self, *args):
        return self.launch_err

    def cuStreamSynchronize(self, stream):
        return ILLEGAL_ADDRESS

    def cuGetErrorName(self, err, ref):
        if err != ILLEGAL_ADDRESS:
            return 1  # CUDA_ERROR_INVALID_VALUE: no name
        ref._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS"
        return 0


@pytest.fixture
def fake(monkeypatch):
    lib = FakeLibcuda()
    monkeypatch.setattr(driver, "_LIBCUDA", lib)
    monkeypatch.setattr(driver, "_libcuda", lambda: lib)
    monkeypatch.setattr(driver, "_BINDINGS_LAUNCH", None)
    monkeypatch.setattr(driver, "_primary_context", lambda device: 2)
    return lib


def _prepared(nargs=3):
    """A Prepared as __init__ leaves it on a GPU, for a kernel of ``nargs`` int64 words
    (context 2, while the thread's current context is 1), without compiling anything."""
    p = object.__new__(driver.Prepared)
    p.name, p.threads, p.smem, p.device, p.handle = "attn_forward", 128, 0, 0, 0
    p._fmt = "<" + "q" * nargs
    p._buf = (ctypes.c_int64 * nargs)()
    base = ctypes.addressof(p._buf)
    p._ptrs = (ctypes.c_void_p * nargs)(*range(base, base + 8 * nargs, 8))
    p._params = ctypes.addressof(p._ptrs)
    p._lock = threading.Lock()
    p._ctx = 2
    p._cur = ctypes.c_void_p()
    p._cur_ref = ctypes.byref(p._cur)
    return p


def test_launch_pops_the_context_it_pushed_when_packing_raises(fake):
    p = _prepared()
    p((1, 1), 0, (1, 2, 3))
    assert fake.stack == [1]
    with pytest.raises(struct.error):
        p((1, 1), 0, (1, "not an int", 3))
    assert fake.stack == [1], "the device's context stayed pushed on the calling thread"


def test_launch_errors_are_named(fake):
    fake.launch_err = ILLEGAL_ADDRESS
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        _prepared()((1, 1), 0, (1, 2, 3))
    assert fake.stack == [1]
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_ILLEGAL_ADDRESS"):
        driver.synchronize(7, 0)
    fake.launch_err = 12345  # no name: the number
    with pytest.raises(RuntimeError, match="CUDA error 12345"):
        _prepared()((1, 1), 0, (1, 2, 3))


def test_compiles_of_different_kernels_do_not_wait_for_each_other(monkeypatch):
    monkeypatch.setattr(driver, "_PREPARED", {})
    builds, overlapped = [], []
    started = {k: threading.Event() for k in "ab"}

    def slow_build(key):
        def build():
            builds.append(key)
            started[key].set()
            # each build waits until the other has started: one after the other (a lock
            # held through builds of different keys), the first would wait in vain
            overlapped.append(started["b" if key == "a" else "a"].wait(timeout=30))
            return key
        return build

    got = []
    threads = [threading.Thread(target=lambda k=k: got.append(driver.prepared(k, slow_build(k))))
               for k in ("a", "b", "a", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(builds) == ["a", "b"], "one build per key"
    assert sorted(got) == ["a", "a", "a", "b"]
    assert overlapped == [True, True], "the two builds ran one after the other"
    assert driver._BUILDING == {}


def test_a_failed_build_keeps_nothing_and_is_tried_again(monkeypatch):
    monkeypatch.setattr(driver, "_PREPARED", {})

    def broken():
        raise RuntimeError("nvvm failed")

    with pytest.raises(RuntimeError, match="nvvm"):
        driver.prepared("k", broken)
    assert driver.prepared("k", lambda: "built") == "built"


def test_torch_scratch_is_allocated_once_under_threads(monkeypatch):
    from flashcore.backends.numba_cuda import adapters

    made = []

    class Buffer:
        def data_ptr(self):
            return id(self)

    def empty(n, dtype, device):
        made.append(device)
        time.sleep(0.2)  # the window in which a second thread once allocated too
        return Buffer()

    monkeypatch.setattr(adapters, "_TORCH_SCRATCH", {})
    monkeypatch.setattr(adapters, "_torch", lambda: type("T", (), {
        "empty": staticmethod(empty), "float32": "float32"}))
    like = type("Like", (), {"device": "cuda:3"})()
    got = []
    threads = [threading.Thread(target=lambda: got.append(
        adapters.ADAPTERS["torch"].scratch(like, 10, 3))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["cuda:3"] and len(set(got)) == 1


def _gpu_case(library="torch", device="cuda:1"):
    from flashcore._case import Case

    return Case(library=library, device=device, dtype="float16", batch=1, heads_q=2,
                heads_kv=2, seqlen_q=8, seqlen_k=8, head_dim=64, causal=False, scale=0.125,
                layout="bhnd")


@pytest.fixture
def two_gpus(monkeypatch):
    """GPU 0 an sm_80, GPU 1 an sm_61 (numba's device attributes stood in for)."""
    import types

    import flashcore.backends.numba_cuda as nc
    from numba import cuda

    gpus = [types.SimpleNamespace(compute_capability=(8, 0)),
            types.SimpleNamespace(compute_capability=(6, 1))]
    monkeypatch.setattr(cuda, "gpus", gpus, raising=False)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "get_current_device", lambda: pytest.fail(
        "the check opened a context on the current GPU"), raising=False)
    nc.unavailable_reason.cache_clear()
    nc._device_reason.cache_clear()
    yield nc
    nc.unavailable_reason.cache_clear()
    nc._device_reason.cache_clear()


def test_each_gpu_is_checked_for_itself(two_gpus):
    assert two_gpus.unavailable_reason() is None  # GPU 0 can serve
    assert two_gpus.supports(_gpu_case(device="cuda:0")) is None
    why = two_gpus.supports(_gpu_case(device="cuda:1"))
    assert why is not None and "cuda:1" in why and "6.1" in why


def test_rocm_builds_are_declined_clearly(two_gpus, monkeypatch):
    import sys
    import types

    torch = types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2.41133", cuda=None))
    monkeypatch.setitem(sys.modules, "torch", torch)
    why = two_gpus.supports(_gpu_case(device="cuda:0"))
    assert why is not None and "ROCm" in why


def test_split_plan_aims_at_warps_per_multiprocessor():
    """num_splits=0: enough splits for SPLIT_WARPS_PER_SM warps on each of the GPU's
    multiprocessors, at most 64, at least 4 key tiles per split; an asked count is kept
    (capped at the key tiles) and the chunks are whole tiles that cover the longest
    sequence."""
    from types import SimpleNamespace

    from flashcore.backends.numba_cuda import launch

    def case(L, batch=8, heads=8, nq=4):
        return SimpleNamespace(batch=batch, heads_q=heads, seqlen_q=nq,
                               kvcache=SimpleNamespace(max_seqlen_k=L))

    decode, big = (16, 64, 1), (128, 64, 4)  # one-warp decode tiles; 4-warp 128-row tiles
    assert launch.SPLIT_WARPS_PER_SM == 8
    # 64 one-warp blocks on 132 multiprocessors: ceil(8 * 132 / 64) = 17 splits
    assert launch.split_plan(case(32768), decode, 0, 132) == (17, 31 * 64)
    # 4k keys: 64 tiles, at most 16 splits of 4 tiles
    assert launch.split_plan(case(4096), decode, 0, 132) == (16, 256)
    # 4-warp blocks of 128 rows: a quarter as many splits for the same warps
    assert launch.split_plan(case(32768, nq=128), big, 0, 132)[0] == 5
    # blocks that fill the GPU alone: no split
    assert launch.split_plan(case(32768, batch=64, heads=32), decode, 0, 132) == (1, 32768)
    # asked counts are kept, at most one per key tile; chunks cover the longest sequence
    for L, asked in ((100, 5), (32768, 3), (1000, 64)):
        splits, chunk = launch.split_plan(case(L), decode, asked, 132)
        assert 1 <= splits <= min(asked, -(-L // 64))
        assert chunk % 64 == 0 and splits * chunk >= L > (splits - 1) * chunk


@pytest.mark.parametrize("grid_x, grid_y", [(5, 3), (7, 8), (4, 20), (64, 64), (3, 17), (1, 9)])
@pytest.mark.parametrize("last_heaviest", [True, False])
def test_causal_tiles_go_out_heaviest_first_by_head_group(grid_x, grid_y, last_heaviest):
    """prologue.block_tile (the device function's Python body) maps the causal grid one to
    one onto (tile, row); in launch order the rows come in groups of HEAD_GROUP (the last
    one smaller), each group handing out its tiles heaviest first (with GROUP 0, the whole
    grid at once); without causal the map is the grid itself."""
    from flashcore.backends.numba_cuda.device.constants import HEAD_GROUP
    from flashcore.backends.numba_cuda.device.prologue import block_tile

    fn = getattr(block_tile, "py_func", block_tile)
    order = [fn(x, y, grid_x, grid_y, True, last_heaviest, HEAD_GROUP)
             for y in range(grid_y) for x in range(grid_x)]  # (launch order: x fastest)
    assert sorted(order) == [(t, r) for t in range(grid_x) for r in range(grid_y)]
    weight = [(grid_x - t if not last_heaviest else t + 1) for t, _ in order]
    for g in range(0, grid_y, HEAD_GROUP):
        rows = min(HEAD_GROUP, grid_y - g)
        part = slice(g * grid_x, (g + rows) * grid_x)
        assert {r for _, r in order[part]} == set(range(g, g + rows))
        assert weight[part] == sorted(weight[part], reverse=True)
    assert [fn(x, y, grid_x, grid_y, False, last_heaviest, HEAD_GROUP)
            for y in range(grid_y) for x in range(grid_x)] == [
        (x, y) for y in range(grid_y) for x in range(grid_x)]
    # GROUP 0 (the mma.sync and SIMT kernels): heaviest first across every row
    every = [fn(x, y, grid_x, grid_y, True, last_heaviest, 0)
             for y in range(grid_y) for x in range(grid_x)]
    assert sorted(every) == sorted(order)
    w = [(grid_x - t if not last_heaviest else t + 1) for t, _ in every]
    assert w == sorted(w, reverse=True)


_KEYS_SCRIPT = """
import hashlib, json, sys
import numba.cuda.dispatcher as nd
from types import SimpleNamespace
nd.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
from numba.cuda.dispatcher import CUDACache
from flashcore.backends.numba_cuda import driver, launch

class Codegen:
    def magic_tuple(self):
        return ("sm_90",)

out = {}
variants = launch.case_variants(64, "bfloat16", True, (9, 0))
variants.append(launch.hopper_variant(64, "bfloat16", True, "forward"))
for v in variants:
    fn, sig = launch.build(v), launch.signature(v.entry, v.dtype)
    ours = driver.variant_cache(fn, launch.cache_key(v))._index_key(sig, Codegen())
    numbas = CUDACache(fn)._index_key(sig, Codegen())
    out[v.tag] = [hashlib.sha256(repr(k).encode()).hexdigest() for k in (ours, numbas)]
print(json.dumps(out))
"""


def test_disk_cache_keys_agree_across_processes(tmp_path):
    """Two processes key each kernel variant's disk-cache entry alike, so that the second
    loads what the first compiled. numba's own key hashes a pickle of the kernel's closure,
    which differs between processes (the closures' device functions pickle with what
    varies: hash-ordered sets, ids), so that most variants were compiled again."""
    import json
    import subprocess
    import sys

    runs = [json.loads(subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True, check=True,
        timeout=600, env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_ENABLE_CUDASIM="0",
                              PYTHONHASHSEED=seed)).stdout.strip().splitlines()[-1])
            for seed in ("1", "2")]  # (string hashes, and so set orders, differ)
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) >= 5
    for tag, (ours, _) in runs[0].items():
        assert runs[1][tag][0] == ours, tag
    assert any(runs[1][tag][1] != numbas for tag, (_, numbas) in runs[0].items())
    assert len({ours for ours, _ in runs[0].values()}) == len(runs[0])  # one per variant


def test_disk_cache_key_follows_the_sources(monkeypatch):
    """A change in any of the backend's sources (a device function's module, not only the
    kernel's) changes every variant's key."""
    from flashcore.backends.numba_cuda import driver, launch

    v = launch.case_variants(64, "float32", False, (9, 0))[0]
    before = launch.cache_key(v)
    monkeypatch.setattr(driver, "sources_digest", lambda: "edited")
    assert launch.cache_key(v) != before


def test_variants_with_user_mods_have_no_disk_cache_key():
    """The user's functions are not part of a key, so a variant with them is never cached."""
    from flashcore.backends.numba_cuda import launch
    from flashcore.backends.numba_cuda.variant import UserMods

    v = launch.case_variants(64, "float32", False, (9, 0))[0]
    assert launch.cache_key(v) is not None
    assert launch.cache_key(replace(v, user=UserMods(abs, None, ()))) is None


def test_preprocess_tiling_takes_whole_warps_and_power_of_two_lanes():
    """tilings.RowTiles: the preprocess's shuffles sum over ``lanes`` (2..32, a power of
    two) inside whole warps; the rows a block sums follow."""
    from flashcore.backends.numba_cuda import tilings

    assert tilings.RowTiles().block_m == 4 and tilings.RowTiles().tag == "t128"
    assert tilings.RowTiles(32, 4).block_m == 8 and tilings.RowTiles(32, 4).tag == "t32l4"
    with pytest.raises(ValueError, match="whole warps; got 48 threads"):
        tilings.RowTiles(48, 16)
    with pytest.raises(ValueError, match="lanes=6 is not a power of two"):
        tilings.RowTiles(64, 6)
    with pytest.raises(ValueError, match="lanes=64"):
        tilings.RowTiles(64, 64)


def test_preprocess_vector_tiling_takes_a_lane_per_16_bytes():
    """The GPU's preprocess tiling: a lane per 16 bytes of a 16-bit row (a power of two,
    2 to 32), 8 16-bit or 4 fp32 elements per lane and step; the scalar form one."""
    from flashcore.backends.numba_cuda import tilings

    lanes = {d: tilings.RowTiles.for_head_dim(d).lanes for d in (8, 16, 32, 64, 96, 128, 256)}
    assert lanes == {8: 2, 16: 2, 32: 4, 64: 8, 96: 16, 128: 16, 256: 32}
    t = tilings.RowTiles.for_head_dim(128)
    assert (t.block_m, t.tag) == (8, "t128l16")
    assert (t.elements("bfloat16"), t.elements("float16"), t.elements("float32")) == (8, 8, 4)
    s = tilings.RowTiles(128, 32, vector=False)
    assert (s.elements("bfloat16"), s.tag) == (1, "t128s")
    assert tilings.choose_simt(128, "bfloat16", True, (9, 0)).preprocess == t


class FakeRingLib(FakeLibcuda):
    """And the calls of the tensor maps' ring (tensor_maps._Ring): a device buffer the
    copies write from the pinned host buffer's bytes, events by number."""

    def __init__(self, dev_base, size):
        super().__init__()
        self.dev_base = dev_base
        self.device = bytearray(size)
        self.copies, self.waits, self.records, self.events = [], [], [], 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
        self.copies.append((dst - self.dev_base, stream))
        self.device[dst - self.dev_base:dst - self.dev_base + n] = ctypes.string_at(src, n)
        return 0

    def cuEventCreate(self, ref, flags):
        self.events += 1
        ref._obj.value = self.events
        return 0

    def cuEventRecord(self, ev, stream):
        self.records.append((ev, stream))
        return 0

    def cuEventSynchronize(self, ev):
        self.waits.append(ev)
        return 0


def test_tensor_map_ring_reuses_a_slot_only_on_its_stream(monkeypatch):
    """The ring of map slots (tensor_maps._Ring) with 3 slots: the same maps again on the
    stream that copied them read their slot without a copy or a wait; on another stream
    they are copied to the next slot; a slot is rewritten only after a wait on the event of
    the launch that last read it, and its old maps are then copied anew; every slot a call
    is given holds that call's bytes; the context is pushed around the driver calls and
    popped after them."""
    from flashcore.backends.numba_cuda import tensor_maps

    monkeypatch.setattr(tensor_maps, "SLOTS", 3)
    n = tensor_maps._SET
    lib = FakeRingLib(0x10000, 3 * n)
    host = ctypes.create_string_buffer(3 * n)
    ring = tensor_maps._Ring(lib, 2, 0x10000, ctypes.addressof(host))
    sets = [bytes([m]) * n for m in range(1, 5)]  # A, B, C, D

    def call(data, stream):
        at, slot = ring.put(data, stream)
        assert at == 0x10000 + slot * n
        assert bytes(lib.device[slot * n:(slot + 1) * n]) == data
        ring.used(slot, stream)
        return slot

    a = call(sets[0], 7)
    assert (a, len(lib.copies), lib.waits) == (0, 1, [])
    assert call(sets[0], 7) == a and len(lib.copies) == 1  # (no copy, no wait)
    assert call(bytes(bytearray(sets[0])), 7) == a and len(lib.copies) == 1  # (equal bytes)
    assert call(sets[0], 8) == 1 and len(lib.copies) == 2  # (another stream)
    assert call(sets[1], 7) == 2 and lib.waits == []
    assert call(sets[2], 7) == 0 and lib.waits == [1]  # slot 0 after A's last launch
    assert call(sets[0], 7) == 1 and lib.waits == [1, 2] and len(lib.copies) == 5
    assert call(sets[1], 7) == 2 and len(lib.copies) == 5  # (still held: no copy)
    assert [r[0] for r in lib.records] == [1, 1, 1, 2, 3, 1, 2, 3]
    assert lib.stack == [1]  # (pushed context 2 around each call's driver calls, popped)


def test_tensor_map_ring_skips_slots_whose_launch_is_not_queued(monkeypatch):
    """A slot handed out (put) and not yet marked read by its launch (used) is not
    rewritten by another thread's call in between, hit or miss; the per-thread default
    stream's handle (2) reuses a slot only on the thread that copied it."""
    from flashcore.backends.numba_cuda import tensor_maps

    monkeypatch.setattr(tensor_maps, "SLOTS", 3)
    n = tensor_maps._SET
    lib = FakeRingLib(0x10000, 3 * n)
    host = ctypes.create_string_buffer(3 * n)
    ring = tensor_maps._Ring(lib, 2, 0x10000, ctypes.addressof(host))
    a, b, c, d = (bytes([m]) * n for m in range(1, 5))
    for data in (a, b, c):
        ring.used(ring.put(data, 7)[1], 7)
    _, held = ring.put(a, 7)  # a hit on slot 0, its launch not queued yet
    assert held == 0
    _, other = ring.put(d, 7)  # the next slot would be 0: skipped
    assert other == 1 and bytes(lib.device[:n]) == a
    ring.used(held, 7)
    ring.used(other, 7)
    assert ring.pending == [0, 0, 0]
    ring.used(ring.put(b, tensor_maps._PER_THREAD)[1], tensor_maps._PER_THREAD)
    copies = len(lib.copies)
    ring.used(ring.put(b, tensor_maps._PER_THREAD)[1], tensor_maps._PER_THREAD)
    assert len(lib.copies) == copies  # (the same thread: reused)
    seen = []
    t = threading.Thread(target=lambda: seen.append(ring.put(b, tensor_maps._PER_THREAD)))
    t.start()
    t.join()
    assert len(lib.copies) == copies + 1  # (another thread's stream: copied again)
    assert lib.copies[-1][1] == tensor_maps._PER_THREAD  # (the handle itself, to the driver)


def test_tensor_maps_are_encoded_once_per_views(monkeypatch):
    """tensor_maps._encoded keeps the three maps per views and sizes: the same views again
    give the same bytes object (the ring's slot lookup keys on it) without encoding; other
    strides or other sizes encode anew."""
    from types import SimpleNamespace

    from flashcore.backends.numba_cuda import tensor_maps

    encoded = []

    class Encoder:
        def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, *rest):
            encoded.append((address, tuple(dims)))
            return 0

    monkeypatch.setattr(tensor_maps, "_lib", Encoder)
    monkeypatch.setattr(tensor_maps, "_kept", tensor_maps.OrderedDict())
    case = SimpleNamespace(dtype="bfloat16", head_dim=64, heads_q=4, heads_kv=2, batch=2,
                           seqlen_q=128, seqlen_k=256, varlen=None)
    q = (0x1000, (32768, 8192, 64, 1))
    k = v = (0x9000, (32768, 16384, 64, 1))
    first = tensor_maps._encoded(case, q, k, v, 128)
    assert len(first) == tensor_maps._SET and len(encoded) == 3
    assert tensor_maps._encoded(case, q, k, v, 128) is first and len(encoded) == 3
    tensor_maps._encoded(case, (0x1000, (32768, 64, 256, 1)), k, v, 128)
    assert len(encoded) == 6
    longer = SimpleNamespace(**{**vars(case), "seqlen_k": 512})
    tensor_maps._encoded(longer, q, k, v, 128)
    assert len(encoded) == 9 and encoded[-1][1] == (64, 512, 2, 2)


@pytest.mark.parametrize("err, status, unknown, want", [
    (0, 0, True, False), (0, 1, False, True), (1, 0, True, True), (1, 0, False, False),
    ("raise", 0, True, True), ("raise", 0, False, False)])
def test_stream_capturing_says_unknown_where_the_driver_cannot_say(monkeypatch, err, status,
                                                                   unknown, want):
    """``driver.stream_capturing``: the driver's status where it answers; ``unknown``
    where it fails (no context, the legacy stream in an implicit capture) or cannot be
    called: True for the tensor maps' safe path, False for a KV-cache call's question
    (which would refuse host lengths on a spurious True)."""
    class Lib:
        def cuStreamIsCapturing(self, stream, out):
            if err == "raise":
                raise OSError("no libcuda")
            ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = status
            return err

    monkeypatch.setattr(driver, "_LIBCUDA", Lib())
    assert driver.stream_capturing(7, unknown=unknown) is want
