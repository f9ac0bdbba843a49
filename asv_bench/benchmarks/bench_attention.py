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
