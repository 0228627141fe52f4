"""The PrivateUse1 engine's meta runs, remembered (`vram.run.engine.privateuse1`).

The engine runs each op on meta copies of its inputs (``_on_meta``): a fresh meta tensor per
simulated tensor, made from nothing but its dtype, sizes, strides and storage offset. A meta
kernel sees only those, the op's other arguments and a few global settings, so the same call
again gives outputs of the same geometry — and in torch 2.13 most meta kernels are Python
(``torch/_meta_registrations.py`` ``activate_meta`` registers the decompositions at the Meta key
over the C++ structured ones: ``_dispatch_dump`` shows those "inactive"), about half of an
estimate's time. `lookup` gives a call seen before its meta inputs and outputs as they were after
the op ran the first time (an in-place op's input as the op left it), which the engine reads
(geometry, dtype) and never changes.

A call is remembered only when all of it is known here: an aten op that draws no random numbers,
simulated dense tensors, and arguments of plain types (numbers, strings, dtypes, devices, lists
of these). A host or meta tensor (a meta kernel may read a CPU tensor's values), a generator or
anything else sends the call to its meta kernel each time; so does a call that raised. A
warning a meta kernel gives (``out=`` resized) comes the first time only. `tests/test_meta_cache.py`
compares a training step's allocations with and without it.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch.fx.experimental import _config as _fx_config

#: at most this many calls are remembered; then the memory starts again (a script whose shapes
#: keep changing costs one bounded dictionary; a GPT-2 training step with AdamW needs 126)
LIMIT = 4096
#: turned off by tests that compare the allocations with and without it
enabled = True

_STRIDED = torch.strided
_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_PYTHON_DISPATCHER = torch._C.DispatchKey.PythonDispatcher
_SEEDED = torch.Tag.nondeterministic_seeded
_CACHE: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
_REMEMBERS: dict[Any, bool] = {}  # by OpOverload: may its calls be remembered?
#: ``_fast.cpp``'s ``key`` and the device type it reads tensors of (PrivateUse1's name), once set
_COMPILED: list[Any] = [None, None]


def _remembers(op: Any) -> bool:
    ok = _REMEMBERS.get(op)
    if ok is None:
        ok = _REMEMBERS[op] = (isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"
                               and _SEEDED not in op.tags)
    return ok


#: the meta kernels' switches in ``torch/fx/experimental/_config.py`` that `_settings` reads
_FX_SWITCHES = ("meta_nonzero_assume_all_nonzero", "skip_dtype_check_in_meta_registrations", "backed_size_oblivious")


def _settings_reference() -> tuple[Any, ...]:
    """The global settings a meta kernel reads: the default dtype (type promotion of Python
    numbers, factories), deterministic algorithms, the Python dispatcher, and the meta kernels'
    own switches (``torch/fx/experimental/_config.py``), each read through its module."""
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch._C._dispatch_tls_is_dispatch_key_included(_PYTHON_DISPATCHER),
            *(getattr(_fx_config, name) for name in _FX_SWITCHES))


def _switch_entries() -> tuple[Any, ...] | None:
    """The switches' config entries when each one's value is, as ``ConfigModule.__getattr__``
    (``torch/utils/_config_module.py``) gives it, the first set of: the forcing environment
    variable, the override (a ``ContextVar``: ``patch`` and assignments set it), the default
    environment variable, the immutable default — no alias, JustKnob or deprecation; else None."""
    table = getattr(_fx_config, "_config", None)
    unset = getattr(sys.modules[type(_fx_config).__module__], "_UNSET_SENTINEL", None)
    if not isinstance(table, dict) or unset is None:
        return None
    entries = tuple(table.get(name) for name in _FX_SWITCHES)
    for e in entries:
        plain = e is not None and getattr(e, "alias", 0) is None and getattr(e, "justknob", 0) is None \
            and not getattr(e, "deprecated", True) and isinstance(getattr(e, "default", None), (bool, int, type(None)))
        if not plain or not all(hasattr(e, a) for a in ("user_override", "env_value_force", "env_value_default")):
            return None
    return (unset, *entries)


_SWITCHES = _switch_entries()
_DEFAULT_DTYPE, _KEY_INCLUDED = torch.get_default_dtype, torch._C._dispatch_tls_is_dispatch_key_included
_DETERMINISTIC = torch._C._get_deterministic_algorithms
_DETERMINISTIC_WARN_ONLY = torch._C._get_deterministic_algorithms_warn_only


def _switch(unset: Any, e: Any) -> Any:
    v = e.env_value_force
    if v is unset:
        v = e.user_override.get()
        if v is unset:
            v = e.env_value_default
            if v is unset:
                v = e.default
    return v


def _settings() -> tuple[Any, ...]:
    """`_settings_reference`, with the switches read from their entries (a read through the config
    module costs ~9 µs each, on every op); the reference where an entry is hidden."""
    if _SWITCHES is None:
        return _settings_reference()
    unset, a, b, c = _SWITCHES
    if a.hide or b.hide or c.hide:
        return _settings_reference()
    # torch.are_deterministic_algorithms_enabled and its warn-only twin, without their Python frames
    return (_DEFAULT_DTYPE(), _DETERMINISTIC(), _DETERMINISTIC_WARN_ONLY(), _KEY_INCLUDED(_PYTHON_DISPATCHER),
            _switch(unset, a), _switch(unset, b), _switch(unset, c))


def _part(a: Any, device_type: str) -> Any:
    """`a`'s share of the key; None when the call cannot be remembered."""
    if isinstance(a, torch.Tensor):
        if a.layout is not _STRIDED or a.device.type != device_type:
            return None
        return (a.dtype, a.shape, a.stride(), a.storage_offset())
    kind = type(a)
    if kind is float:
        return (float, a.hex())  # -0.0 and 0.0 apart
    if kind in _PLAIN:
        return (kind, a)
    if kind is list or kind is tuple:
        parts: list[Any] = [kind]
        for x in a:
            p = _part(x, device_type)
            if p is None:
                return None
            parts.append(p)
        return tuple(parts)
    return None


def use_compiled(compiled_key: Any, device_type: str) -> None:
    """Make keys of calls on `device_type` (PrivateUse1's name) with ``_fast.cpp``'s ``key``, the
    compiled form of `key_reference`."""
    _COMPILED[:] = [compiled_key, device_type]


def key(op: Any, args: Any, kwargs: Any, device_type: str) -> tuple[Any, ...] | None:
    """What `op`'s meta run on these arguments depends on; None when it is not remembered.
    `key_reference`'s, made by its compiled form where that is in use and can read the arguments."""
    if not enabled or not _remembers(op):
        return None
    settings = _settings()
    compiled, compiled_for = _COMPILED
    if compiled is not None and device_type == compiled_for:
        k = compiled(op, settings, args, kwargs)
        if k is not NotImplemented:
            return k  # type: ignore[no-any-return]
    return key_reference(op, settings, args, kwargs, device_type)


def key_reference(op: Any, settings: tuple[Any, ...], args: Any, kwargs: Any,
                  device_type: str) -> tuple[Any, ...] | None:
    """The key of a call whose op may be remembered: the op, the `settings`, each argument's `_part`."""
    parts: list[Any] = [op, settings]
    for a in args:
        p = _part(a, device_type)
        if p is None:
            return None
        parts.append(p)
    for name, a in kwargs.items():
        p = _part(a, device_type)
        if p is None:
            return None
        parts.append((name, p))
    return tuple(parts)


def lookup(k: tuple[Any, ...] | None) -> tuple[Any, Any, Any] | None:
    """(meta args, meta kwargs, outputs) of the call `k` seen before, or None."""
    return None if k is None else _CACHE.get(k)


def remember(k: tuple[Any, ...] | None, margs: Any, mkwargs: Any, out: Any) -> None:
    if k is None:
        return
    if len(_CACHE) >= LIMIT:
        _CACHE.clear()
    _CACHE[k] = (margs, mkwargs, out)


def clear() -> None:
    """Forget every remembered call."""
    _CACHE.clear()
