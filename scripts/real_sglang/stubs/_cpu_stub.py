"""Stand-ins for two packages SGLang 0.5.9 imports unconditionally but never calls on a CPU without AMX.

- ``sgl_kernel``: PyPI's 0.3.21 is CUDA-only (its import fails on ``libnvrtc.so.12``); on this CPU SGLang's
  ``torch_native`` path runs plain torch ops and never calls a kernel.
- ``torchvision``: PyPI's builds link against CUDA torch, so their compiled ops cannot load beside the CPU
  wheel (``operator torchvision::nms does not exist``); SGLang imports it only for vision models' preprocessing.

Every attribute and every submodule is a class whose use raises :class:`NotImplementedError` naming what was
called, so a real call fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _StubMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(f"{cls.__qualname__} is a CPU test stand-in (scripts/real_sglang/stubs)")

    def __getitem__(cls, item: object) -> type:
        return cls

    def __or__(cls, other: object) -> type:
        return cls

    __ror__ = __or__


def stub_class(name: str) -> type:
    return _StubMeta(name.rsplit(".", 1)[-1], (), {"__qualname__": name, "__module__": name.rsplit(".", 1)[0]})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub_class(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: str, version: str) -> None:
    """Make ``package`` (already importing: its ``__init__``) and every submodule of it stand-ins."""
    module = sys.modules[package]
    module.__class__ = _StubModule
    module.__version__ = version
    sys.meta_path.insert(0, _Finder(package))
