"""Packed sequences and KV-cache decoding (issue 15) on the CPU and on a GPU.

- ``DecodeCPU``: ``flashcore.attention_with_kvcache`` (numba_cpu) for one new query token
  per sequence against a cache of ``cache_len`` keys, B=1, Hq=32, Hkv=8, D=128, float32,
  contiguous or paged (pages of 256 keys), next to torch SDPA on the same dense cache
  (``enable_gqa``; SDPA has no paged cache). ``track_gbps``: bytes of K and V read per
  second, the number a decoding step is bound by.
- ``VarlenCPU``: ``flashcore.attention_varlen`` forward on 4 packed sequences of 512,
  1024, 256 and 2304 tokens (H=8, D=64, float32, causal), next to the same sequences as
  separate ``flashcore.attention`` calls (the work without padding) and as one padded
  batch of 4 x 2304 (what padding costs).

- ``DecodeGPU``: the issue's decoding step on a GPU: B=8, Hq=32, Hkv=8, D=128, bf16, one
  query token, 4k/32k/128k cached keys, contiguous or paged (256), numba_cuda (split-KV by
  its heuristic) next to SDPA on the dense cache; ``track_gbps`` as on the CPU.
- ``VarlenGPU``: 16 sequences of 128..4096 tokens (seeded), H=16, D=128, bf16, causal or
  not: ``attention_varlen`` forward next to ``attention`` on the batch padded to the
  longest (what padding costs).
Calls on a GPU wait for it (``torch.cuda.synchronize``); machines without one skip them.

Run as a script for a quick table: ``python asv_bench/benchmarks/bench_packed.py``.
"""
import time

import numpy as np

B, HQ, HKV, D, PAGE = 1, 32, 8, 128, 256
LENGTHS = (512, 1024, 256, 2304)
VH, VD = 8, 64


def _import(name):
    try:
        return __import__(name)
    except ImportError as e:
        raise NotImplementedError(f"{name} is not installed") from e


class DecodeCPU:
    param_names = ["contender", "cache_len", "cache"]
    params = [["flashcore:numba_cpu", "torch_sdpa"], [4096, 32768], ["contiguous", "paged"]]
    number = 1
    repeat = (3, 10, 20.0)
    warmup_time = 0.0
    timeout = 600

    def setup(self, contender, cache_len, cache):
        import flashcore

        rng = np.random.default_rng(0)
        q = rng.standard_normal((B, 1, HQ, D), dtype=np.float32)
        k = rng.standard_normal((B, cache_len, HKV, D), dtype=np.float32)
        v = rng.standard_normal((B, cache_len, HKV, D), dtype=np.float32)
        self.bytes = k.nbytes + v.nbytes
        seqlens = np.full(B, cache_len, np.int32)
        if contender == "torch_sdpa":
            if cache == "paged":
                raise NotImplementedError("SDPA has no paged KV cache")
            torch = _import("torch")
            tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
            f = torch.nn.functional.scaled_dot_product_attention

            def run():
                with torch.no_grad():
                    f(tq, tk, tv, enable_gqa=True)
        else:
            table = None
            if cache == "paged":  # the same keys, in pages placed in reverse order
                n = cache_len // PAGE
                k = k.reshape(B * n, PAGE, HKV, D)[::-1].copy()
                v = v.reshape(B * n, PAGE, HKV, D)[::-1].copy()
                table = (B * n - 1 - np.arange(B * n, dtype=np.int32)).reshape(B, n)

            def run():
                flashcore.attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                 block_table=table, backend="numba_cpu")
        run()  # compile
        self.run = run

    def time_decode(self, *params):
        self.run()

    def track_gbps(self, *params):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            self.run()
            times.append(time.perf_counter() - t)
        return self.bytes / sorted(times)[2] / 1e9

    track_gbps.unit = "GB/s"


class VarlenCPU:
    param_names = ["how"]
    params = [["varlen", "separate", "padded"]]
    number = 1
    repeat = (3, 10, 20.0)
    warmup_time = 0.0
    timeout = 600

    def setup(self, how):
        import flashcore

        rng = np.random.default_rng(0)
        total = sum(LENGTHS)
        q, k, v = (rng.standard_normal((total, VH, VD), dtype=np.float32) for _ in range(3))
        cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
        if how == "varlen":
            def run():
                flashcore.attention_varlen(q, k, v, cu, cu, causal=True, backend="numba_cpu")
        elif how == "separate":
            parts = [tuple(x[None, a:b].transpose(0, 2, 1, 3).copy() for x in (q, k, v))
                     for a, b in zip(cu[:-1], cu[1:])]

            def run():
                for p in parts:
                    flashcore.attention(*p, causal=True, backend="numba_cpu")
        else:
            n = max(LENGTHS)
            pad = [np.zeros((len(LENGTHS), VH, n, VD), np.float32) for _ in range(3)]
            for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                for x, y in zip(pad, (q, k, v)):
                    x[s, :, : b - a] = y[a:b].transpose(1, 0, 2)

            def run():
                flashcore.attention(*pad, causal=True, backend="numba_cpu")
        run()
        self.run = run

    def time_forward(self, how):
        self.run()


def _cuda_torch():
    torch = _import("torch")
    if not torch.cuda.is_available():
        raise NotImplementedError("no CUDA GPU")
    return torch


class DecodeGPU:
    param_names = ["contender", "cache_len", "cache"]
    params = [["flashcore:numba_cuda@gpu", "torch_sdpa@gpu"], [4096, 32768, 131072],
              ["contiguous", "paged"]]
    number = 1
    repeat = (5, 20, 10.0)
    warmup_time = 0.0
    timeout = 600

    def setup(self, contender, cache_len, cache):
        torch = _cuda_torch()
        import flashcore

        b, dt = 8, torch.bfloat16
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=dt, generator=g)
        k = torch.randn(b, cache_len, HKV, D, device="cuda", dtype=dt, generator=g)
        v = torch.randn(b, cache_len, HKV, D, device="cuda", dtype=dt, generator=g)
        self.bytes = 2 * k.numel() * k.element_size()
        seqlens = torch.full((b,), cache_len, dtype=torch.int32, device="cuda")
        if contender == "torch_sdpa@gpu":
            if cache == "paged":
                raise NotImplementedError("SDPA has no paged KV cache")
            tq, tk, tv = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            f = torch.nn.functional.scaled_dot_product_attention

            def call():
                f(tq, tk, tv, enable_gqa=True)
        else:
            table = None
            if cache == "paged":  # the same keys, in pages placed in reverse order
                n = cache_len // PAGE
                k = k.reshape(b * n, PAGE, HKV, D).flip(0).contiguous()
                v = v.reshape(b * n, PAGE, HKV, D).flip(0).contiguous()
                table = (b * n - 1 - torch.arange(b * n, dtype=torch.int32, device="cuda")
                         ).reshape(b, n)

            def call():
                flashcore.attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                 block_table=table, backend="numba_cuda")

        def run():
            call()
            torch.cuda.synchronize()
        run()  # compile
        self.run = run

    def time_decode(self, *params):
        self.run()

    def track_gbps(self, *params):
        return DecodeCPU.track_gbps(self, *params)

    track_gbps.unit = "GB/s"


class VarlenGPU:
    param_names = ["how", "causal"]
    params = [["varlen", "padded"], [False, True]]
    number = 1
    repeat = (5, 20, 10.0)
    warmup_time = 0.0
    timeout = 600

    def setup(self, how, causal):
        torch = _cuda_torch()
        import flashcore

        lengths = np.random.default_rng(0).integers(128, 4097, size=16)
        h, d, dt = 16, 128, torch.bfloat16
        total = int(lengths.sum())
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dt, generator=g)
                   for _ in range(3))
        cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        cu = torch.from_numpy(cu_host).cuda()
        if how == "varlen":
            def call():
                flashcore.attention_varlen(q, k, v, cu, cu, max_seqlen_q=int(lengths.max()),
                                           max_seqlen_k=int(lengths.max()), causal=causal,
                                           backend="numba_cuda")
        else:
            n = int(lengths.max())
            pad = [torch.zeros(len(lengths), h, n, d, device="cuda", dtype=dt)
                   for _ in range(3)]
            for s_, (a, b) in enumerate(zip(cu_host[:-1], cu_host[1:])):
                for x, y in zip(pad, (q, k, v)):
                    x[s_, :, : b - a] = y[a:b].transpose(0, 1)

            def call():
                flashcore.attention(*pad, causal=causal, backend="numba_cuda")

        def run():
            call()
            torch.cuda.synchronize()
        run()
        self.run = run

    def time_forward(self, *params):
        self.run()


if __name__ == "__main__":
    import itertools

    for cls in (DecodeCPU, VarlenCPU, DecodeGPU, VarlenGPU):
        for params in itertools.product(*cls.params):
            bench = cls()
            try:
                bench.setup(*params)
            except NotImplementedError as e:
                print(cls.__name__, params, "skip:", e)
                continue
            times = []
            for _ in range(7):
                t = time.perf_counter()
                bench.run()
                times.append(time.perf_counter() - t)
            med = sorted(times)[3]
            extra = (f"  {bench.bytes / med / 1e9:.1f} GB/s" if hasattr(bench, "bytes")
                     else "")
            print(f"{cls.__name__} {params}: {med * 1e3:.1f} ms{extra}", flush=True)
