"""Launching a Triton kernel again without the JIT's per-call work.

Why: `kernel[grid](...)` binds and specialises every argument, builds the cache key and looks the compiled
variant up on every call: on the H200 a row-kernel launch cost 28 us of host time against 18 us for a
cuBLAS mm of the same shape, a tile-product launch 45 us against 15 us
(`benchmarks/repro/profile_batch_invariant_host.py --device cuda --launches`), and batch-invariant mode's
eager steps are host-bound with ~250 such launches each.

`DirectLaunch` calls the JIT once per variant (the argument dtypes, the integer widths the JIT would give
the unspecialised integers, the constexpr values, the device), keeps the compiled kernel it returns and
afterwards calls that kernel's launcher with the same arguments, in the same order, as the JIT itself
passes them (launch metadata and hooks included, so profilers still see each launch; with no hook
registered, none and no metadata). The compiled code is
the JIT's, so the results are its bits. The kernels it serves specialise no integer on its value and no
pointer on its alignment (their `do_not_specialize` lists), so nothing else selects a variant. Where the
Triton version has no `knobs` (older than 3.4), or once a direct call is refused, every launch goes
through the JIT.
"""

from __future__ import annotations

import operator

import torch

_I32 = (-(2**31), 2**31 - 1)
_dtype = operator.attrgetter("dtype")

try:  # (Triton >= 3.4: the launch hooks live in `triton.knobs`)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no direct launches
    _knobs = None


def _no_hook(hook) -> bool:
    """Whether a launch hook calls nothing: None, or an empty `HookChain` (Triton >= 3.6 keeps chains, empty
    unless a profiler adds to them, and the launcher calls them, with metadata built for them, at every
    launch). The launcher skips a None hook."""
    return hook is None or getattr(hook, "calls", None) == []


class DirectLaunch:
    """`fn[grid](*tensors, *ints, **constexprs)` for a `triton.jit` function whose parameters are its
    tensors, then its integers, then its constexprs (in that order)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.enabled = _knobs is not None
        self._kernels: dict[tuple, object] = {}
        self._constexprs: tuple[str, ...] | None = None  # the constexpr names in signature order
        self.direct_launches = 0  # (tests: the direct path is taken)

    def __call__(self, grid: tuple[int, ...], tensors: tuple, ints: tuple, **constexprs) -> None:
        key = None
        if self.enabled:
            # the integer widths: one flag when every integer fits in 32 bits (every call of the row
            # kernels so far), else one per integer (a key of its own, never a wrong variant)
            small = not ints or (_I32[0] <= min(ints) and max(ints) <= _I32[1])
            widths = True if small else tuple(_I32[0] <= v <= _I32[1] for v in ints)
            device = tensors[0].get_device()
            key = (*map(_dtype, tensors), widths, *constexprs.items(), device)
            kernel = self._kernels.get(key)
            if kernel is not None:
                g = (*grid, 1, 1)
                stream = torch._C._cuda_getCurrentRawStream(device)
                args = (*tensors, *ints, *map(constexprs.__getitem__, self._constexprs))
                enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
                if _no_hook(enter) and _no_hook(leave):  # nothing would see the metadata: skip building it
                    enter = leave = meta = None
                else:
                    meta = kernel.launch_metadata(grid, stream, *args)
                try:
                    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, enter,
                               leave, *args)  # fmt: skip
                    self.direct_launches += 1
                    return
                except TypeError:  # a launcher of another signature: the JIT from now on
                    self.enabled = False
                    self._kernels.clear()
        kernel = self.fn[grid](*tensors, *ints, **constexprs)
        if key is not None and self.enabled and hasattr(kernel, "run") and hasattr(kernel, "packed_metadata"):
            params = self.fn.params
            names = tuple(p.name for p in params if p.is_constexpr)
            # tensors, then integers, then constexprs; no value- or alignment-specialised parameter (it would
            # select variants the key does not see). Otherwise every launch stays with the JIT.
            layout = len(params) == len(tensors) + len(ints) + len(names) and set(names) == set(constexprs)
            fixed = (
                layout
                and all(getattr(p, "do_not_specialize_on_alignment", False) for p in params[: len(tensors)])
                and all(
                    getattr(p, "do_not_specialize", False)
                    for p in params[len(tensors) : len(tensors) + len(ints)]
                )
            )
            if not fixed:
                self.enabled = False
                return
            self._constexprs = names
            self._kernels[key] = kernel
