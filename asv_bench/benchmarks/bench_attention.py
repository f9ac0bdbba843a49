"""Attention forward and forward+backward: flashcore's backends next to the peers.

Each class is one direction on one kind of device; its parameters are the contender (see
``flashcore.bench.contender_names()``), the sequence length, the head dim, the dtype and the
causal mask, at batch 1 and 8 heads on the CPU, batch 4 and 16 heads on a GPU. ``setup``
makes seeded inputs, runs once (compiling) and raises NotImplementedError for a combination
that cannot run here (no GPU, library missing, no kernel for the case, too little memory for
a contender that materializes the score matrix).

- ``time_attention``: one call; GPU calls wait for the device (``torch.cuda.synchronize``
  or ``block_until_ready``) before the clock stops.
- ``peakmem_attention``: asv's peak resident memory of the process around one call.
- ``track_extra_host_mib``: the growth of the resident set during one call, outputs
  included, inputs excluded (see flashcore.bench: VmHWM reset per call on Linux).
- ``track_gpu_peak_mib``: peak device memory above the baseline during one call.

``MaskedForwardCPU`` / ``MaskedForwardBackwardCPU``: numba_cpu and torch SDPA at B=1 H=4
N=2048 D=64 float32, without a mask, with ``window:512`` and with ``docs:8`` (see
``flashcore.bench.masks``); ``track_gflops`` counts the visible pairs only.
"""
import os

from .common import prepare, runner

CPU_CONTENDERS = ["flashcore:numba_cpu", "torch_sdpa", "jax_xla", "numpy_naive"]
GPU_CONTENDERS = ["flashcore:numba_cuda@gpu", "torch_sdpa_flash@gpu", "torch_sdpa_cudnn@gpu",
                  "torch_sdpa_efficient@gpu", "torch_sdpa_math@gpu", "jax_cudnn@gpu",
                  "jax_xla@gpu", "torch_naive@gpu"]


class _Attention:
    direction = "fwd"
    batch, heads = 1, 8
    param_names = ["contender", "seqlen", "head_dim", "dtype", "causal"]
    # setup already ran the call once (compiling); each sample is one call
    number = 1
    warmup_time = 0.0
    repeat = (1, 3, 10.0)
    rounds = 1
    timeout = 300

    def setup(self, contender, seqlen, head_dim, dtype, causal):
        self.config = runner.Config(self.batch, self.heads, seqlen, head_dim, dtype, causal)
        self.prep = prepare(contender, self.config, self.direction)

    def teardown(self, *params):
        self.prep = None

    def time_attention(self, *params):
        self.prep.run()


class _CPU(_Attention):
    params = [CPU_CONTENDERS, [1024, 4096], [64, 128], ["float32"], [False, True]]

    def peakmem_attention(self, *params):
        self.prep.run()

    def track_extra_host_mib(self, *params):
        extra, _ = runner.peak_extra_host_bytes(self.prep.run)
        return None if extra is None else extra / 2**20

    track_extra_host_mib.unit = "MiB"


class _GPU(_Attention):
    batch, heads = 4, 16
    #: The grid recorded over the repository's history on the H200 (record_gpu.sh):
    #: flashcore next to FA2 at DESIGN.md's anchor size, small enough to replay commits.
    #: Every machine discovers this grid (a machine without a GPU skips it in setup), so
    #: benchmarks.json and the dashboard agree. FLASHCORE_ASV_GPU_GRID=full measures all
    #: GPU contenders over N, D, dtype and causal instead.
    params = [["flashcore:numba_cuda@gpu", "torch_sdpa_flash@gpu"], [4096], [64, 128],
              ["bfloat16", "float32"], [False]]
    if os.environ.get("FLASHCORE_ASV_GPU_GRID") == "full":
        params = [GPU_CONTENDERS, [1024, 4096, 16384], [64, 128], ["bfloat16", "float32"],
                  [False, True]]

    def track_gpu_peak_mib(self, *params):
        extra = runner.gpu_peak_extra_bytes(self.prep)
        return None if extra is None else extra / 2**20

    track_gpu_peak_mib.unit = "MiB"


class ForwardCPU(_CPU):
    direction = "fwd"


class ForwardBackwardCPU(_CPU):
    direction = "fwdbwd"


class ForwardGPU(_GPU):
    direction = "fwd"


class ForwardBackwardGPU(_GPU):
    direction = "fwdbwd"


class LongSequenceMemoryCPU(_Attention):
    """Peak extra memory of the forward pass at N=16384, where the score matrix alone would
    take 8 GiB; a tiled kernel should stay under 64 MiB."""

    params = [["flashcore:numba_cpu", "torch_sdpa", "numpy_naive"], [16384], [64],
              ["float32"], [False]]
    timeout = 600

    def track_extra_host_mib(self, *params):
        extra, _ = runner.peak_extra_host_bytes(self.prep.run)
        return None if extra is None else extra / 2**20

    track_extra_host_mib.unit = "MiB"


class _MaskedCPU(_Attention):
    """flashcore next to torch SDPA (given the same mask as a boolean ``attn_mask``) without a
    mask, with a 512-key sliding window and with 8 equal documents (flashcore: the mask_mod
    ``same_doc`` and a BlockMask made in setup), at a size a 2-core machine measures in
    seconds. The FLOP model counts the visible pairs only (``runner.masks``); the time is
    what the issue's targets compare: window and docs against full, flashcore against SDPA."""

    batch, heads = 1, 4
    param_names = ["contender", "mask"]
    params = [["flashcore:numba_cpu", "torch_sdpa"], ["none", "window:512", "docs:8"]]
    seqlen, head_dim, dtype = 2048, 64, "float32"

    def setup(self, contender, mask):
        self.config = runner.Config(self.batch, self.heads, self.seqlen, self.head_dim,
                                    self.dtype, False, mask)
        self.prep = prepare(contender, self.config, self.direction)

    def track_gflops(self, *params):
        """Nominal GFLOP/s over the visible pairs, from the median of 3 timed runs."""
        times = runner.time_runs(self.prep, repeat=3, warmup=0)
        return self.config.flops(self.direction) / sorted(times)[1] / 1e9

    track_gflops.unit = "GFLOP/s"


class MaskedForwardCPU(_MaskedCPU):
    direction = "fwd"


class MaskedForwardBackwardCPU(_MaskedCPU):
    direction = "fwdbwd"
