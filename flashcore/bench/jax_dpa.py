"""The JAX peer: ``jax.nn.dot_product_attention`` (XLA or cuDNN), jitted."""
from __future__ import annotations

from .config import to_library
from .contender import Contender
from .libraries import gpu_memory_for, import_jax, sync_for
from .measure import Prepared


class JaxDpa(Contender):
    """``jax.nn.dot_product_attention`` with ``implementation`` "xla" or "cudnn", jitted,
    on ``(B, N, H, D)`` arrays (JAX's own layout)."""

    library = "jax"

    def __init__(self, implementation: str = "xla", device: str = "cpu"):
        self.implementation, self.device = implementation, device
        self.name = f"jax_{implementation}" + ("" if device == "cpu" else "@gpu")
        self.materializes = implementation == "xla"
        self.description = f"jax.nn.dot_product_attention(implementation={implementation!r})"

    def mask_reason(self, config):
        if config.mask == "none":
            return None
        return (f"the bench gives jax.nn.dot_product_attention no masks yet (mask "
                f"{config.mask})")

    def unavailable_reason(self, config=None):
        if self.implementation == "cudnn" and self.device == "cpu":
            return "cuDNN needs a GPU"
        if config is not None and config.dtype == "float64":
            return "JAX computes float64 only with jax_enable_x64, which the bench leaves off"
        if config is not None and self.implementation == "cudnn" and config.dtype not in (
                "float16", "bfloat16"):
            return "JAX's cuDNN attention takes float16 and bfloat16 only"
        return super().unavailable_reason(config)

    def _prepare(self, config, direction, host):
        jax = import_jax()
        q, k, v, do = (to_library(a, "jax", self.device, layout="bnhd") for a in host)
        impl, causal = self.implementation, config.causal

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

        if direction == "fwd":
            fj = jax.jit(f)

            def call():
                return fj(q, k, v)
        else:
            fbj = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))

            def call():
                return fbj(q, k, v, do)
        # JAX on a GPU: no CUDA events of its own, so perf_counter around block_until_ready
        return Prepared(call, sync_for("jax", self.device), "perf_counter",
                        gpu_memory_for("jax", self.device))
