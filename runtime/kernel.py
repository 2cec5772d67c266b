"""Backend-neutral kernel descriptions (docs/contract.md section 2).

A :class:`Kernel` names its buffer :class:`Binding` s and scalar :class:`Param` s once and carries
one source per backend: a WGSL compute shader, a CUDA C function, and a numpy callable.

Conventions every backend follows:

- Counts are in **workgroups** ``(x, y, z)``; ``workgroup_size`` is the invocations per workgroup.
- WGSL: entry point ``main``; binding ``i`` is ``@group(0) @binding(i)`` in the order given; the
  params, if any, are one uniform struct at ``@group(0) @binding(len(bindings))`` with the fields
  in order, each 4 bytes (``f32``/``i32``/``u32``).
- CUDA C: ``extern "C" __global__ void <name>(T* binding0, ..., param0, ...)``; block size =
  ``workgroup_size``, grid = ``count``.
- cpu: ``cpu(*views, count=(x, y, z), **params)``; each binding arrives as a 1-D numpy view of the
  whole buffer (the handle's bytes) in its dtype; the callable mutates the views in place
  (a ``read`` binding's view is read-only: a body writing it fails with a ``LaunchError``).
  Optionally the callable has a ``bind`` attribute, ``cpu.bind(*views, count=..., **params) ->
  callable()``: the same work as one zero-argument call with views, params and output bound once
  (e.g. ``functools.partial(np.add, x[:n], alpha, y[:n])``). A software graph on the cpu
  backend resolves each recorded launch into it at capture, so a replay is a loop of such calls
  (issue 26); without it the graph calls ``cpu`` with the recorded arguments. A ``fuse``
  attribute besides (``runtime.kernels.pointwise.elementwise``) describes the launch as one
  float32 op of ``runtime.backends.cpu_fuse``, which runs a run of such launches as one
  compiled call.
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Callable, NamedTuple

import numpy as np

#: Element types a binding or param may have (WGSL's names), with their numpy dtype: the one
#: dtype table (4 bytes each; ``DTYPES[d].char`` is the ``struct`` code params pack with).
DTYPES: dict[str, np.dtype] = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32),
                               "u32": np.dtype(np.uint32)}
#: The CUDA C name of each dtype (kernels' CUDA sources typedef the WGSL names to these).
C_TYPES: dict[str, str] = {"f32": "float", "i32": "int", "u32": "unsigned int"}
ACCESS = ("read", "read_write", "write")


class Binding(NamedTuple):
    """A buffer argument of a kernel.

    Args:
        name: the argument's name (used in messages).
        dtype: element type, one of ``"f32"``, ``"i32"``, ``"u32"``.
        access: ``"read"``, ``"read_write"`` or ``"write"``: decides the read and write sets of
            a captured graph, the cross-stream ordering of a launch and how a failure mark
            propagates (docs/contract.md section 4). ``"read_write"``: the launch may read the
            earlier contents (``y += x``, a KV cache written at one position), so a failure mark
            on the buffer stays; ``"write"``: the launch never reads them and rewrites what it
            covers (``y = x + 1``), so a launch whose inputs are clean clears the mark. Both are
            WebGPU ``read_write`` storage (WebGPU has no write-only storage buffer).
    """

    name: str
    dtype: str = "f32"
    access: str = "read"


class Param(NamedTuple):
    """A scalar argument of a kernel, 4 bytes (``"f32"``, ``"i32"`` or ``"u32"``)."""

    name: str
    dtype: str = "f32"


def _spec(kernel: str, kind: str, cls, value, example: str):
    """``value`` as a ``cls`` (``Binding``/``Param``): one already, or a tuple of its fields. A
    bare string (``"x"``) is refused: it would unpack letter by letter (``Binding(*"yy")`` is
    name ``"y"``, dtype ``"y"``)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, (tuple, list)) and 1 <= len(value) <= len(cls._fields) and \
            isinstance(value[0], str):
        return cls(*value)
    raise TypeError(f"kernel {kernel}: each {kind} is a runtime.{cls.__name__} or a tuple "
                    f"({', '.join(cls._fields)}), e.g. {example}; got {value!r}")


class Kernel:
    """A compute kernel: bindings, params, workgroup size and one source per backend.

    Args:
        name: the kernel's name; the CUDA entry point has this name.
        bindings: the buffer arguments, in order.
        params: the scalar arguments, in order (WGSL uniform struct fields / CUDA value args).
        workgroup_size: invocations per workgroup ``(x, y, z)`` (CUDA block size).
        wgsl: WGSL source with entry point ``main`` (or ``None``: not available on wgpu).
        cuda: CUDA C source defining ``extern "C" __global__ void <name>(...)`` (or ``None``).
        cpu: numpy callable ``cpu(*views, count=..., **params)`` (or ``None``).
        elements: the integer param that counts the elements the kernel touches in its
            bindings (``i < n``), declared so that a launch naming more elements than a bound
            buffer holds is refused instead of clamped or run out of bounds: a param name (every
            binding holds at least that many elements of its dtype) or a mapping
            ``{binding name: param name}`` (only those bindings, e.g. ``add_bias``, whose bias
            holds ``N``, not ``n``), where a tuple of param names is their product (a matmul's
            ``{"a": ("M", "K"), "w": ("K", "N"), "out": ("M", "N")}``; kept in
            ``product_checks``). ``None`` (the default): nothing is declared, nothing
            checked. Declare it only where it is exactly true: the server refuses a launch
            (``LaunchError``), a capture window (``stop_capture`` raises) and a
            ``Graph.update`` (``ValueError``) whose param exceeds a handle's
            ``nbytes // itemsize`` (:meth:`elements_error`). On the GPU backends the sources
            test ``i < n`` only: without this, ``n`` past the buffer reads and writes out of
            bounds on cuda and is clamped on wgpu (WebGPU robust buffer access).
        checks: messages of the kernel's device-side checks (a bad value read on the device,
            e.g. a token id outside its table: what ``IndexError`` is on cpu). Check ``k``
            (1-based) fails with ``atomicMax(&err_flag[0], ku)`` in the source: on wgpu
            ``err_flag`` is the storage binding after the others (after the params' uniform,
            ``array<atomic<u32>>``), bound by the backend; the launch (or the replay holding it)
            then fails with ``LaunchError`` naming the kernel and ``checks[k - 1]``, found after
            its submit, which marks what it writes (docs/contract.md section 4: a read raises).
            On cuda ``err_flag`` is a ``__device__`` global nobody reads yet: not checked there.
            ``()`` (the default): none.
        ranges: ``{param name: (lo, hi)}``: the values an integer param may take (inclusive;
            ``hi`` ``None``: no upper bound), where the device sources hold a fixed size (a
            workgroup array of ``MAX_CACHE`` rows, a head dim compiled in) or need a value of
            at least 1 (a divisor, a row count ``T`` clamped to ``T - 1``): ``pack_params``
            (every launch, capture and ``Graph.update``) raises ``ValueError`` outside them on
            every backend, instead of a GPU reading past the array, computing with the compiled
            size or wrapping ``0u - 1u`` where the cpu body raises. ``None``: none.

    Raises:
        TypeError / ValueError: a malformed description (a binding or param that is not a
            tuple or Binding/Param, unknown dtype or access, no source,
            an ``elements`` that names no integer param or no binding).

    Kernels hash by identity: the server compiles each ``Kernel`` object once and caches the
    program (a pipeline on wgpu, a ``RawKernel`` on cuda).
    """

    __slots__ = ("name", "bindings", "params", "workgroup_size", "wgsl", "cuda", "cpu",
                 "param_names", "accesses", "_f32", "_get", "_types", "_ints", "elements",
                 "element_checks", "product_checks", "checks", "ranges", "_ranges",
                 "write_checks", "grid_elements", "count_error", "extents", "_touch",
                 "__weakref__")

    def __init__(self, name: str, bindings, params=(), workgroup_size=(64, 1, 1), *,
                 wgsl: str | None = None, cuda: str | None = None, cpu: Callable | None = None,
                 elements=None, checks=(), ranges=None):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"kernel name must be an identifier, got {name!r}")
        self.name = name
        self.bindings = tuple(_spec(name, "binding", Binding, b, "('x', 'f32', 'read_write')")
                              for b in bindings)
        self.params = tuple(_spec(name, "param", Param, p, "('n', 'u32')") for p in params)
        for b in self.bindings:
            if b.dtype not in DTYPES:
                raise ValueError(f"kernel {name}: binding {b.name} has dtype {b.dtype!r}; use one of {list(DTYPES)}")
            if b.access not in ACCESS:
                raise ValueError(f"kernel {name}: binding {b.name} has access {b.access!r}; use one of {ACCESS}")
        for p in self.params:
            if p.dtype not in DTYPES:
                raise ValueError(f"kernel {name}: param {p.name} has dtype {p.dtype!r}; use one of {list(DTYPES)}")
        wg = (workgroup_size,) if isinstance(workgroup_size, int) else tuple(workgroup_size)
        self.workgroup_size = tuple(int(v) for v in wg) + (1,) * (3 - len(wg))
        if len(self.workgroup_size) != 3 or min(self.workgroup_size) < 1:
            raise ValueError(f"kernel {name}: workgroup_size must be 1 to 3 positive ints, got {workgroup_size!r}")
        if wgsl is None and cuda is None and cpu is None:
            raise ValueError(f"kernel {name}: give at least one source (wgsl=, cuda= or cpu=)")
        self.wgsl, self.cuda, self.cpu = wgsl, cuda, cpu
        self.param_names = tuple(p.name for p in self.params)
        #: each binding's access, in order (what the launch path tests per binding)
        self.accesses = tuple(b.access for b in self.bindings)
        self._f32 = tuple(p.dtype == "f32" for p in self.params)
        # pack_params' fast path: one C call takes the values of >= 2 params out of a dict,
        # then their Python types are compared at once (float for f32, int otherwise)
        self._get = operator.itemgetter(*self.param_names) if len(self.params) >= 2 else None
        self._types = tuple(float if f else int for f in self._f32)
        self._ints = tuple(i for i, f in enumerate(self._f32) if not f)
        self.elements = elements
        #: ``((binding index, param index, itemsize), ...)``: what a launch checks (empty: none)
        checks_ = self._element_checks(elements)
        self.element_checks = tuple(c for c in checks_ if type(c[1]) is int)
        #: ``((binding index, (param index, ...), itemsize), ...)``: the product declarations
        #: (a separate tuple: the launch path tests it once, empty for most kernels)
        self.product_checks = tuple(c for c in checks_ if type(c[1]) is tuple)
        #: the ``element_checks``/``product_checks`` of ``write`` bindings (:meth:`partial_write`)
        self.write_checks = tuple(c for c in checks_ if self.accesses[c[0]] == "write")
        #: per binding, ``((param index or indices, itemsize), ...)`` of its declared counts
        #: (:meth:`touched_bytes`)
        self._touch = tuple(tuple((c[1], c[2]) for c in checks_ if c[0] == i)
                            for i in range(len(self.bindings)))
        #: ``grid_elements(count) -> int``: the most elements a direct workgroup count
        #: ``(x, y, z)`` lets the kernel write, and read, of each binding (``elementwise``:
        #: ``x * y * WORKGROUP``: invocation ``i`` touches element ``i`` only), or None (not
        #: declared: the declared ``elements`` count is taken as written). A launch whose
        #: grid covers fewer elements than its buffer holds writes it only in part
        #: (:meth:`partial_write`) and reads no more (:meth:`touched_bytes`).
        self.grid_elements = None
        #: ``count_error(count, params) -> str | None``: why a direct workgroup count ``(x, y,
        #: z)`` covers less of the work its packed ``params`` name than the kernel needs, or
        #: None (the library's row, matmul, attention and gather kernels: their cpu bodies do
        #: the whole work whatever the count while the GPU sources do the part the count
        #: covers; the server refuses such a launch, a capture and a ``Graph.update`` on every
        #: backend). None (the default): not checked.
        self.count_error = None
        #: ``{binding index: fn(params, count) -> int}``: for a ``read`` binding the most
        #: elements a launch with packed ``params`` and direct workgroup ``count`` ``(x, y, z)``
        #: reads, for a ``write`` binding the elements it rewrites, a prefix of the buffer,
        #: where ``elements`` cannot say it (the attention kernels touch ``B * S`` rows, ``B``
        #: from the count; ``argmax`` writes one element). None: not declared (the declared
        #: ``elements``, else the whole buffer). A ``write`` binding with one has an entry
        #: ``(index, None, itemsize)`` in ``write_checks`` (:meth:`partial_write`).
        #: ``runtime.kernels.pointwise.touches`` declares them.
        self.extents = None
        if isinstance(checks, str) or not all(isinstance(m, str) for m in checks):
            raise TypeError(f"kernel {name}: checks must be a sequence of messages (str), "
                            f"got {checks!r}")
        self.checks = tuple(checks)
        self.ranges = dict(ranges or {})
        #: ``((param index, lo, hi), ...)`` of ``ranges`` (empty: pack_params' one extra test)
        self._ranges = self._range_checks(self.ranges)

    def _range_checks(self, ranges) -> tuple:
        out = []
        for pname, bounds in ranges.items():
            if pname not in self.param_names or self.params[self.param_names.index(pname)].dtype == "f32":
                raise ValueError(f"kernel {self.name}: ranges names {pname!r}, not one of its "
                                 f"integer params {[p.name for p in self.params if p.dtype != 'f32']}")
            try:                                # (operator.index: ints, numpy ints; no floats)
                lo, hi = bounds
                lo, hi = operator.index(lo), None if hi is None else operator.index(hi)
                ok = not isinstance(bounds[0], bool) and (hi is None or lo <= hi)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"kernel {self.name}: ranges[{pname!r}] must be (lo, hi) with "
                                 f"integers lo <= hi (hi None: no upper bound), got {bounds!r}")
            out.append((self.param_names.index(pname), lo, float("inf") if hi is None else hi))
        return tuple(out)

    def _range_error(self, out: tuple) -> None:
        for i, lo, hi in self._ranges:
            if not lo <= out[i] <= hi:
                if hi == float("inf"):
                    raise ValueError(f"kernel {self.name}: param {self.param_names[i]}={out[i]} "
                                     f"must be at least {lo}")
                raise ValueError(f"kernel {self.name}: param {self.param_names[i]}={out[i]} is "
                                 f"outside [{lo}, {hi}], the sizes its device sources hold")

    def _element_checks(self, elements) -> tuple:
        if elements is None:
            return ()
        bnames = [b.name for b in self.bindings]
        if isinstance(elements, str):
            pairs = [(b, elements) for b in bnames]
        elif isinstance(elements, dict):
            pairs = list(elements.items())
        else:
            raise TypeError(f"kernel {self.name}: elements must be a param name or a dict "
                            f"{{binding: param}}, got {type(elements).__name__}")
        out = []
        for b, pnames in pairs:
            if b not in bnames:
                raise ValueError(f"kernel {self.name}: elements names binding {b!r}; it has {bnames}")
            product = isinstance(pnames, tuple)
            for pname in (pnames if product else (pnames,)):
                if pname not in self.param_names or self.params[self.param_names.index(pname)].dtype == "f32":
                    raise ValueError(f"kernel {self.name}: elements names {pname!r}, not one of its "
                                     f"integer params {[p.name for p in self.params if p.dtype != 'f32']}")
            bi = bnames.index(b)
            pi = (tuple(self.param_names.index(n) for n in pnames) if product
                  else self.param_names.index(pnames))
            out.append((bi, pi, DTYPES[self.bindings[bi].dtype].itemsize))
        return tuple(out)

    def partial_write(self, bi: int, params: tuple, nbytes: int, count=None) -> bool:
        """Whether a launch with packed ``params`` writes the buffer of ``write`` binding ``bi``
        (``nbytes`` bytes) only in part: the element count it declares for that binding
        (``elements=``, a product), or fewer when its direct workgroup ``count`` covers fewer
        (:attr:`grid_elements`), times the itemsize is less than ``nbytes``. Such a
        ``write`` keeps the buffer's failure mark (docs/contract.md section 4: the rest still
        holds what a failed writer left). False when the binding declares no count (a
        ``write`` binding is then taken to rewrite its whole buffer)."""
        for b, pi, size in self.write_checks:
            if b == bi:
                if pi is None:              # an extent (``extents``): from the params and count
                    if type(count) is not tuple or self.extents[bi](params, count) * size < nbytes:
                        return True
                    continue
                n = params[pi] if type(pi) is int else math.prod(params[i] for i in pi)
                if self.grid_elements is not None and type(count) is tuple:
                    n = min(n, self.grid_elements(count))
                if n * size < nbytes:
                    return True
        return False

    def touched_bytes(self, bi: int, params: tuple, count=None) -> int | None:
        """The most bytes of binding ``bi``'s buffer a launch with packed ``params`` and
        workgroup ``count`` touches, a prefix of the buffer: the element count the kernel
        declares for it (``elements=``: it touches elements ``i < n`` only; a product of
        params), fewer where a direct ``count`` covers fewer (:attr:`grid_elements`) or where
        the kernel declares the binding's extent (:attr:`extents`), times the itemsize (for a
        ``write`` binding: what it rewrites); None when nothing is declared
        (the whole buffer). Capture-time analysis only (``runtime.server.capture.sources``: a
        ``write`` hides a later read only where it covers what that read touches)."""
        entries, ext = self._touch[bi], self.extents
        if not entries and ext is None:
            return None
        out = None
        direct = type(count) is tuple
        if ext is not None and bi in ext and direct:
            out = ext[bi](params, count) * DTYPES[self.bindings[bi].dtype].itemsize
        if entries:
            grid = self.grid_elements if direct else None
            for pi, size in entries:
                n = params[pi] if type(pi) is int else math.prod(params[i] for i in pi)
                if grid is not None:
                    n = min(n, grid(count))
                if out is None or n * size < out:
                    out = n * size
        return out

    def elements_error(self, params: tuple, nbytes, hids=None) -> str | None:
        """Why a launch with packed ``params`` over buffers of ``nbytes`` (bytes, one per
        binding, in order) would touch elements past a buffer's end, or None when it would not.

        The message names the kernel, the ``elements`` param, its value, the binding, the
        handle (``hids[i]``, when given) and its element count (``nbytes // itemsize`` of the
        binding's dtype). Costs nothing for a kernel that declares no ``elements``.
        """
        for bi, pi, size in self.element_checks + self.product_checks:
            if type(pi) is int:
                n, what = params[pi], self.param_names[pi]
            else:
                n, what = 1, "*".join(self.param_names[i] for i in pi)
                for i in pi:
                    n *= params[i]
            have = nbytes[bi] // size
            if n > have:
                b = self.bindings[bi]
                handle = f"handle {hids[bi]}" if hids is not None else "its buffer"
                shown = f"param {what}={n}" if type(pi) is int else (
                    f"params {what} = {n} (" + ", ".join(f"{self.param_names[i]}={params[i]}"
                                                          for i in pi) + ")")
                return (f"kernel {self.name}: {shown} exceeds the "
                        f"{have} elements ({b.dtype}) of binding {b.name} ({handle}, "
                        f"{nbytes[bi]} bytes); pass {what} <= {have} or bind a "
                        "larger buffer")
        return None

    def __repr__(self):
        return f"Kernel({self.name!r}, bindings={len(self.bindings)}, params={list(self.param_names)})"

    def pack_params(self, values) -> tuple:
        """Order and coerce param values.

        Args:
            values: ``None``, a mapping name -> value, or a sequence in param order.
        Returns:
            a tuple of Python ``float``/``int`` in param order.
        Raises:
            TypeError / ValueError: missing, unknown or non-numeric params; ``ValueError``: a
                param outside its declared ``ranges``.
        """
        if values is None:
            values = ()
        if type(values) is dict and len(values) == len(self.params):
            get = self._get                       # fast path: exact names, plain numbers
            try:
                out = get(values) if get is not None else tuple(map(values.__getitem__,
                                                                    self.param_names))
            except KeyError:
                out = None
            if out is not None and tuple(map(type, out)) == self._types:
                for i in self._ints:
                    if not 0 <= out[i] < 2147483648:
                        break
                else:
                    if self._ranges:
                        self._range_error(out)
                    return out
        if isinstance(values, dict):
            unknown = set(values) - set(self.param_names)
            if unknown:
                raise ValueError(f"kernel {self.name}: unknown params {sorted(unknown)}; it takes {list(self.param_names)}")
            missing = [n for n in self.param_names if n not in values]
            if missing:
                raise ValueError(f"kernel {self.name}: missing params {missing}")
            values = [values[n] for n in self.param_names]
        else:
            values = list(values)
            if len(values) != len(self.params):
                raise ValueError(f"kernel {self.name}: takes {len(self.params)} params {list(self.param_names)}, got {len(values)}")
        out = []
        for p, v in zip(self.params, values):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"kernel {self.name}: param {p.name} must be a number, got {type(v).__name__}")
            if p.dtype == "f32":
                out.append(float(v))
            else:
                try:
                    iv = int(v)
                except (OverflowError, ValueError):         # inf, nan
                    raise ValueError(f"kernel {self.name}: param {p.name} ({p.dtype}) must be an "
                                     f"integer, got {v!r}") from None
                if iv != v:
                    raise ValueError(f"kernel {self.name}: param {p.name} ({p.dtype}) must be an integer, got {v!r}")
                lo, hi = (0, 2**32 - 1) if p.dtype == "u32" else (-2**31, 2**31 - 1)
                if not lo <= iv <= hi:
                    raise ValueError(f"kernel {self.name}: param {p.name}={iv} is out of range for {p.dtype}")
                out.append(iv)
        out = tuple(out)
        if self._ranges:
            self._range_error(out)
        return out

    def uniform_bytes(self, values: tuple) -> bytes:
        """Params packed as a WGSL uniform struct: 4 bytes each, padded to 16 bytes."""
        fmt = "<" + "".join(DTYPES[p.dtype].char for p in self.params)
        try:
            data = struct.pack(fmt, *values)
        except OverflowError:   # an f32 param past float32's range: +-inf, as numpy rounds it
            with np.errstate(over="ignore"):        # (the cpu backend computes with that too;
                values = tuple(float(np.float32(v)) if p.dtype == "f32" else v   # struct raised)
                               for p, v in zip(self.params, values))
            data = struct.pack(fmt, *values)
        return data + b"\0" * (-len(data) % 16 or (16 if not data else 0))


def normalize_count(count) -> tuple:
    """Workgroup count as an ``(x, y, z)`` tuple of non-negative ints.

    Raises:
        TypeError: not an int or a sequence of 1 to 3 ints.
        ValueError: a negative entry.
    """
    if count.__class__ is tuple and len(count) == 3:      # the common case, checked cheaply
        x, y, z = count
        if x.__class__ is int and y.__class__ is int and z.__class__ is int and (
                x >= 0 and y >= 0 and z >= 0):
            return count
    if isinstance(count, (int, np.integer)) and not isinstance(count, bool):
        c = (int(count), 1, 1)
    elif isinstance(count, (tuple, list)) and 1 <= len(count) <= 3 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in count):
        c = tuple(int(v) for v in count) + (1,) * (3 - len(count))
    else:
        raise TypeError(f"count must be an int, an (x, y, z) tuple of workgroups or a Handle, got {count!r}")
    if min(c) < 0:
        raise ValueError(f"count must be non-negative, got {c}")
    return c
