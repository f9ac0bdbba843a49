"""The rational tanh of the CPU float32 kernels (``backends/numba_cpu/scalar.py``:
``TANH_P``, ``TANH_Q``): ``tanh(x) ~ x P(x^2) / Q(x^2)`` on ``|x| <= 9`` (tanh(9) is 1 in
float32), P of degree 4 and Q of degree 4 in ``x^2``, ``Q(0) = 1``, fitted to the relative
error by Sanathanan-Koerner iterations (each a linear least-squares problem weighted by
the previous denominator) with Lawson weights after the first 20 (towards the minimax
fit). Prints the coefficients and the largest relative error in float64 arithmetic on a
finer grid. NumPy only.

Usage: python tools/fit_tanh.py [--clamp 9] [--p 5] [--q 4]
"""
from __future__ import annotations

import argparse

import numpy as np


def fit(clamp, n_p, n_q, iterations=200):
    """``(p, q, max relative error on the fitting grid)``; ``q[0] = 1``."""
    x = np.concatenate([np.linspace(1e-5, 1, 3000), np.linspace(1, clamp, 6000)])
    y, f = x * x, np.tanh(x)
    q_prev, lw, best = np.ones_like(x), np.ones_like(x), None
    for it in range(iterations):
        a = np.concatenate([x[:, None] * y[:, None] ** np.arange(n_p),
                            -(f[:, None] * y[:, None] ** np.arange(1, n_q + 1))], 1)
        w = lw / (f * q_prev)
        sol, *_ = np.linalg.lstsq(a * w[:, None], f * w, rcond=None)
        p, q = sol[:n_p], np.r_[1.0, sol[n_p:]]
        q_prev = np.polyval(q[::-1], y)
        err = (x * np.polyval(p[::-1], y) / q_prev - f) / f
        worst = float(np.abs(err).max())
        if best is None or worst < best[2]:
            best = (p, q, worst)
        if it > 20:
            lw = lw * (np.abs(err) / worst) ** 0.3
            lw /= lw.mean()
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clamp", type=float, default=9.0)
    ap.add_argument("--p", type=int, default=5, help="coefficients of P")
    ap.add_argument("--q", type=int, default=4, help="degree of Q in x^2")
    args = ap.parse_args(argv)
    p, q, worst = fit(args.clamp, args.p, args.q)
    x = np.linspace(1e-6, args.clamp, 2_000_001)
    y = x * x
    approx = x * np.polyval(p[::-1], y) / np.polyval(q[::-1], y)
    rel = float(np.abs(approx / np.tanh(x) - 1).max())
    print("TANH_P =", ", ".join(f"{c:.17g}" for c in p))
    print("TANH_Q =", ", ".join(f"{c:.17g}" for c in q))
    print(f"max relative error: {worst:.3g} on the fitting grid, {rel:.3g} on 2e6 points; "
          f"Q >= {np.polyval(q[::-1], y).min():.6g} on [0, {args.clamp}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
