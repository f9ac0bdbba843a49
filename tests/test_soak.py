"""Concurrent calls give the results serial calls give, bitwise (issue 19, section 6).

8 threads call forward and backward at once, each on its own inputs (different shapes,
GQA, causal or not), released together by a barrier and repeating a few times; every result
must equal, bit for bit, the one a serial call gave. The soak itself (10,000 calls, memory
watched) is ``tools/soak.py``, a tool to run rather than a test.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import flashcore

THREADS = 8
ROUNDS = 3
#: (B, Hq, Hkv, Nq, Nk, D, causal) per thread
SHAPES = [
    (1, 2, 1, 64, 64, 32, False),
    (1, 2, 2, 64, 64, 32, True),
    (2, 4, 2, 48, 80, 32, False),
    (1, 4, 1, 80, 48, 32, True),
    (2, 2, 2, 128, 128, 64, True),
    (1, 1, 1, 33, 33, 64, False),
    (1, 8, 4, 1, 96, 32, True),
    (2, 2, 1, 100, 100, 16, False),
]


def _numba_layer_or_skip():
    import numba
    from flashcore.backends.numba_cpu.backward_kernels import attn_backward_preprocess

    x = np.ones((1, 1, 1, 1), np.float32)
    attn_backward_preprocess(x, x, np.zeros((1, 1, 1), np.float32), np.dtype(np.float32))
    if numba.threading_layer() == "workqueue":
        pytest.skip("numba's workqueue threading layer is not thread-safe (concurrent calls "
                    "abort the process); install tbb or use OpenMP")


def _inputs(n, to=lambda a: a):
    B, Hq, Hkv, Nq, Nk, D, causal = SHAPES[n]
    rng = np.random.default_rng(100 + n)
    q = rng.standard_normal((B, Hq, Nq, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, Hkv, Nk, D), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal((B, Hq, Nq, D), dtype=np.float32)
    return [to(x) for x in (q, k, v, do)], causal


def _numpy_call(inputs, causal):
    q, k, v, do = inputs
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cpu")
    return (o, lse, *flashcore.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                  backend="numba_cpu"))


def _torch_call(inputs, causal):
    import torch

    q, k, v, do = inputs
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True, backend="numba_cpu")
    grads = torch.autograd.grad(o, (q, k, v), do)
    return tuple(x.detach().numpy() for x in (o, lse, *grads))


def _concurrent_equals_serial(call, inputs):
    serial = [call(*inputs[n]) for n in range(THREADS)]
    results = [[None] * ROUNDS for _ in range(THREADS)]
    errors = []
    start = threading.Barrier(THREADS)

    def worker(n):
        try:
            start.wait()
            for r in range(ROUNDS):
                results[n][r] = call(*inputs[n])
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append((n, e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    names = ("o", "lse", "dq", "dk", "dv")
    for n in range(THREADS):
        for r in range(ROUNDS):
            for name, want, got in zip(names, serial[n], results[n][r]):
                assert np.array_equal(np.asarray(want), np.asarray(got)), (
                    f"thread {n} (shape {SHAPES[n]}), round {r}: {name} differs from the "
                    f"serial call")


def test_threads_numpy_numba_cpu_bitwise_equal_serial():
    _numba_layer_or_skip()
    _concurrent_equals_serial(_numpy_call, [_inputs(n) for n in range(THREADS)])


@pytest.mark.torch
def test_threads_torch_numba_cpu_bitwise_equal_serial():
    torch = pytest.importorskip("torch")
    _numba_layer_or_skip()
    _concurrent_equals_serial(_torch_call,
                              [_inputs(n, torch.from_numpy) for n in range(THREADS)])
