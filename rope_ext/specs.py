"""The ops of the ``rope_ext`` namespace, each described once (:class:`OpSpec`), read from its schemas.

Importing this module loads the extension, the one place that does: ``rope_ext._C`` (every schema and the
CPU kernels) and, when torch has CUDA, ``rope_ext._C_cuda`` (the CUDA kernels). A description holds what
the registered schemas say (argument names, defaults, overloads) and the Python checks of the public
function that calls the op; the layers derive what they need from it:

* the public functions (ops.py, serving.py) write the op's arguments once, in schema order (``inputs``,
  the arguments without a default, and ``options``), and hand them to :meth:`OpSpec.check` then
  :meth:`OpSpec.call`; an eager fast path (an exact-type guard) skips the checks and calls
  :meth:`OpSpec.eager`, running them only when the op rejects the call (:meth:`OpSpec.reject`): one
  overload choice and one set of checks for both paths;
* fakes.py registers a fake kernel for every overload, autograd.py the backward of the functional ops,
  distributed.py a DTensor sharding rule for every overload; each reads the arguments by name
  (:meth:`OpSpec.bind`).

The short overloads (``.plain``, ``.scaled``) take the first arguments of the default overload: the inputs,
and for ``.scaled`` the first Tensor options, which it requires. A boxed call costs time per schema
argument, passed or defaulted, so an eager call takes the shortest overload that holds every option not at
its default. Traced calls take the default overload, so that a graph names one op whatever the options.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import Tensor

from . import _C, checks  # noqa: F401  (_C registers torch.ops.rope_ext.*: the schemas, the CPU kernels)

_is_compiling = torch.compiler.is_compiling


def _load_cuda_kernels() -> str | None:
    """Import ``rope_ext._C_cuda`` (it registers the CUDA kernels) when this torch has CUDA.

    Returns the library's path, or None: a torch without CUDA never loads it (the library needs
    libtorch_cuda), and a build without it (no nvcc) has none. A library that cannot load under this
    torch (say, built for another CUDA major version) leaves the CPU kernels working and says why.
    """
    if torch.version.cuda is None or importlib.util.find_spec("rope_ext._C_cuda") is None:
        return None
    try:
        return importlib.import_module("rope_ext._C_cuda").__file__
    except ImportError as e:
        warnings.warn(f"rope_ext: the CUDA kernels did not load, CPU only: {e}", stacklevel=2)
        return None


CUDA_LIBRARY = _load_cuda_kernels()


def built_with_cuda() -> bool:
    """Whether the CUDA kernels are registered (this build has them and this torch has CUDA)."""
    return CUDA_LIBRARY is not None


__all__ = [
    "CACHE",
    "MLA_CACHE",
    "CUDA_LIBRARY",
    "OPS",
    "QK_NORM",
    "QK_NORM_",
    "QK_NORM_PACKED_",
    "REROTATE",
    "ROTARY",
    "ROTARY_QK",
    "ROTARY_QK_",
    "OpSpec",
    "built_with_cuda",
]


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.TensorType)


def _is_optional_tensor(t: Any) -> bool:
    return isinstance(t, torch.OptionalType) and _is_tensor(t.getElementType())


class OpSpec:
    """One op: its schemas' arguments and overloads, and the checks its public function runs.

    ``name``: the op's name in ``torch.ops.rope_ext``. ``check``: the op's own Python checks (checks.py),
    run after those every op gets (each Tensor argument of the schema is a tensor, or None where the
    schema allows it); it takes the arguments by name and returns them as the op takes them.

    Attributes: ``name``, ``op`` (the default overload), ``overloads`` (every overload, the default first),
    ``names`` (the argument names in schema order), ``n_inputs`` (how many come before the options, which
    have defaults), ``Args`` (a named tuple of the arguments with the schema's defaults: :meth:`bind`).
    """

    def __init__(self, name: str, check: Callable[[Any], Any] | None = None) -> None:
        packet = getattr(torch.ops.rope_ext, name)
        self.name = name
        self.op = packet.default
        self.overloads = tuple(getattr(packet, o) for o in sorted(packet.overloads(), key="default".__ne__))
        arguments = self.op._schema.arguments
        self.names = tuple(a.name for a in arguments)
        n_inputs = sum(not a.has_default_value() for a in arguments)
        options = arguments[n_inputs:]
        assert all(a.has_default_value() for a in options), f"{name}: inputs first, then the options"
        self.Args = collections.namedtuple(
            f"{name}_args", self.names, defaults=[a.default_value for a in options]
        )
        # The Tensor arguments (by index), and those of them that may be None.
        self._tensors = tuple(
            i for i, a in enumerate(arguments) if _is_tensor(a.type) or _is_optional_tensor(a.type)
        )
        self._optional = frozenset(i for i, a in enumerate(arguments) if _is_optional_tensor(a.type))
        self._check = check

        # The options: Tensor options (default None) first, then the value options. A short overload takes
        # the inputs and its first n Tensor options, which it requires (n = 0: the bare overload, .plain;
        # n = 2: .scaled): it takes an eager call whose value options are all at their defaults, whose
        # first n Tensor options are given and whose other Tensor options are None. A short overload may
        # instead take the inputs and the last value options, which it requires (.paged: page_table): it
        # takes an eager call whose Tensor options are None and whose other value options are at their
        # defaults.
        self.n_inputs = n_inputs
        n_tensor = sum(_is_optional_tensor(a.type) for a in options)
        assert not any(_is_optional_tensor(a.type) for a in options[n_tensor:]), f"{name}: Tensor ones first"
        self._defaults = tuple(a.default_value for a in options)
        self._tensor_options = tuple(range(n_tensor))
        self._values = slice(n_tensor, None)
        self._value_defaults = self._defaults[n_tensor:]
        self._bare = None
        self._with_tensors = []  # (overload, n, the Tensor options it takes, those it drops)
        self._with_last = []  # (overload, where its value options start among the options)
        # Each overload's argument names (bind: a call's positional arguments by the overload's names).
        self._names_of = {o: tuple(a.name for a in o._schema.arguments) for o in self.overloads}
        for overload in self.overloads[1:]:
            names = self._names_of[overload]
            n = len(names) - n_inputs
            assert self.names[:n_inputs] == names[:n_inputs], overload
            if self.names[: n_inputs + n] != names:
                assert n > 0 and self.names[len(self.names) - n :] == names[n_inputs:], overload
                self._with_last.append((overload, len(self._defaults) - n))
                continue
            assert 0 <= n <= n_tensor, f"{overload}: the inputs and Tensor options only"
            if n == 0:
                self._bare = overload
            else:
                self._with_tensors.append((overload, n, tuple(range(n)), tuple(range(n, n_tensor))))

    def __repr__(self) -> str:
        return f"OpSpec({self.name!r})"

    def bind(self, args: tuple, kwargs: dict[str, Any] | None = None, overload: Any = None) -> Any:
        """The arguments of a call of ``overload`` (the default, or one whose arguments are the default's
        first ones, when None), by name (``Args``); options it omits at their defaults."""
        if overload is None:
            return self.Args(*args, **(kwargs or {}))
        return self.Args(**dict(zip(self._names_of[overload], args, strict=False)), **(kwargs or {}))

    def names_of(self, overload: Any) -> tuple[str, ...]:
        """The argument names of ``overload``, in its schema's order."""
        return self._names_of[overload]

    def check(self, inputs: tuple, options: tuple) -> Any:
        """The Python checks of a call (they write nothing): every Tensor argument is a tensor (or None where
        optional), in schema order, then the op's own checks. Returns the arguments as the op takes them,
        by name (``Args``)."""
        a = self.Args._make(inputs + options)
        for i in self._tensors:
            t = a[i]
            if not isinstance(t, Tensor) and not (t is None and i in self._optional):
                checks.require_tensor(self.names[i], t, i in self._optional)
        return a if self._check is None else self._check(a)

    def eager(self, inputs: tuple, options: tuple) -> Any:
        """The op on ``inputs`` and ``options`` (every option, in schema order) in an eager call, through the
        shortest overload that holds every option not at its default. Value options compare with ``==``
        (``0`` is ``False``; ``None`` is not, the op reads it as ``False``); Tensor options are given or None
        (never compared with ``==``: a tensor compares element-wise)."""
        if self._bare is not None:
            # Every option at its default: the overload without options. Tensor options (None by default)
            # are tested first, so that the comparison never meets a tensor.
            for i in self._tensor_options:
                if options[i] is not None:
                    break
            else:
                if options == self._defaults:
                    return self._bare(*inputs)
                for op, start in self._with_last:
                    # its options given, the value options before them at their defaults
                    if None not in options[start:] and options[:start] == self._defaults[:start]:
                        return op(*(inputs + options[start:]))
                return self.op(*(inputs + options))
        if options[self._values] == self._value_defaults:
            for op, n, given, absent in self._with_tensors:
                for i in given:
                    if options[i] is None:
                        break
                else:
                    for i in absent:
                        if options[i] is not None:
                            break
                    else:
                        return op(*(inputs + options[:n]))
        return self.op(*(inputs + options))

    def call(self, a: tuple) -> Any:
        """The op on ``a`` (every argument, in schema order, as :meth:`check` returns them): eager calls
        through :meth:`eager`, traced calls through the default overload."""
        if len(self.overloads) == 1 or _is_compiling():
            return self.op(*a)
        n = self.n_inputs
        return self.eager(a[:n], a[n:])

    def reject(self, inputs: tuple, options: tuple, error: Exception) -> NoReturn:
        """For an eager fast path, which called :meth:`eager` without :meth:`check` (an exact-type guard let
        the call through) and got ``error``: raises what the checked call raises, the checks' error if
        any (they run first there), else ``error`` as the API raises it."""
        try:
            self.check(inputs, options)
        except Exception as e:
            raise e from None
        raise checks.retyped(error) from None


ROTARY = OpSpec("rotary", checks.rotary_args)
ROTARY_QK = OpSpec("rotary_qk", checks.rotary_args)
ROTARY_QK_ = OpSpec("rotary_qk_", checks.rotary_args)
CACHE = OpSpec("rotary_qk_cache_", checks.cache_args)
MLA_CACHE = OpSpec("mla_rotary_cache_", checks.mla_args)
REROTATE = OpSpec("rerotate_kv_cache_", checks.rerotate_args)
QK_NORM = OpSpec("qk_norm_rotary", checks.qk_norm_args)
QK_NORM_ = OpSpec("qk_norm_rotary_", checks.qk_norm_args)
QK_NORM_PACKED_ = OpSpec("qk_norm_rotary_packed_", checks.qk_norm_packed_args)
OPS = (ROTARY, ROTARY_QK, ROTARY_QK_, CACHE, MLA_CACHE, REROTATE, QK_NORM, QK_NORM_, QK_NORM_PACKED_)
