"""What the benchmark classes share: the runner, seeded inputs cached per size, and the
setup that turns "cannot run here" into asv's skip (NotImplementedError).

The runner is the package ``flashcore/bench/`` of the tree these benchmarks live in, loaded
by path under the name ``flashcore_bench_runner``: asv benchmarks older commits with today's
benchmark code, and those commits' flashcore may not have the package (or have an older
one). The measured code is always the installed flashcore of the commit under test; the
measuring code is the same for every commit. The one rule the measuring code takes from
flashcore, the mask rule of ``flashcore/_rules.py`` (for the naive contender), comes from
this tree too where the installed flashcore predates that module.
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_by_path(name, path, package=False):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[os.path.dirname(path)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and relative imports look it up by name
    spec.loader.exec_module(module)
    return module


def _load_runner():
    init = os.path.join(ROOT, "flashcore", "bench", "__init__.py")
    if not os.path.exists(init):  # a copy of the suite without the tree beside it
        from flashcore import bench

        return bench
    if importlib.util.find_spec("flashcore._rules") is None:
        import flashcore

        flashcore._rules = _load_by_path("flashcore._rules",
                                         os.path.join(ROOT, "flashcore", "_rules.py"))
    return _load_by_path("flashcore_bench_runner", init, package=True)


runner = _load_runner()

#: Without a CUDA device node, GPU setups skip at once, without importing torch to ask.
HAS_GPU = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl"))

SEED = 0
_INPUTS = {}


def inputs(config):
    """Seeded ``(q, k, v, do)`` NumPy arrays for ``config``, made once per size (one size is
    kept at a time, so a sweep holds one set of inputs)."""
    if config not in _INPUTS:
        _INPUTS.clear()
        _INPUTS[config] = runner.host_inputs(config, SEED)
    return _INPUTS[config]


def _declined(e):
    """A contender saying it has no kernel for this case (not a bug to report as a failure)."""
    text = f"{type(e).__name__}: {e}"
    return (type(e).__name__ in ("BackendUnavailableError", "NotImplementedError")
            or "No available kernel" in text or "not supported" in text.lower()
            # a commit whose flashcore predates masks and score modifiers
            or "unexpected keyword argument" in text or "create_block_mask" in text)


def prepare(name, config, direction):
    """The contender ``name`` ready to run ``config`` once per call, warmed up (compiled);
    NotImplementedError where it cannot run here."""
    contender = runner.get_contender(name)
    if contender.device != "cpu" and not HAS_GPU:
        raise NotImplementedError("no CUDA GPU on this machine")
    why = contender.unavailable_reason(config)
    if why is not None:
        raise NotImplementedError(why)
    try:
        prep = contender.prepare(config, direction, SEED, host=inputs(config))
        prep.run()
    except Exception as e:
        if _declined(e):
            raise NotImplementedError(f"{name} declined: {e}") from e
        raise
    return prep
