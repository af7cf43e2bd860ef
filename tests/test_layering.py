"""The import rules between the packages, checked by parsing every module's imports (ast).

  * pallas_kernels imports nothing from jax_sparse_mla (the kernels know nothing of the layer);
  * among jax_sparse_mla's modules only kernels.py imports pallas_kernels (the one dispatch point);
  * plan.py and policy.py (the host-side batch plan and its decisions) import no kernel module,
    neither pallas_kernels nor jax_sparse_mla.kernels, directly or through other jax_sparse_mla
    modules they import;
  * the layer never imports the harness: no jax_sparse_mla module outside the harness subpackage
    jax_sparse_mla.serving (the serving loop, synthetic.Harness, the demo) imports it, bar
    jax_sparse_mla.__main__, the command line whose command is the demo;
  * the harness holds the only page allocator: the one *Allocator class of jax_sparse_mla and
    pallas_kernels is jax_sparse_mla.serving.allocator.PageAllocator;
  * tests import no other test module (no test_*.py, no conftest): shared helpers live in the
    tests.support package.

Every import counts, module-level or inside a function. `from pkg import name` is an import of
the module pkg.name when that is a module of the repository, else of pkg itself (its
__init__.py). The package __init__.py files that Python runs on the way to a submodule are not
counted as imports of the importing module (jax_sparse_mla/__init__.py imports everything; a
module that imports `jax_sparse_mla.policy` does not thereby depend on it).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jax_sparse_mla", "pallas_kernels", "tests")
KERNEL_MODULES = ("pallas_kernels", "jax_sparse_mla.kernels")
HOST_PLANNING = ("jax_sparse_mla.plan", "jax_sparse_mla.policy")
HARNESS = "jax_sparse_mla.serving"
HARNESS_IMPORTERS = ("jax_sparse_mla.__main__",)  # the command line runs the demo
THE_ALLOCATOR = ("jax_sparse_mla.serving.allocator", "PageAllocator")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the repository's packages: dotted name -> file."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of module `name`, relative ones resolved."""
    path = MODULES[name]
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = node.module
            for alias in node.names:
                sub = f"{pkg}.{alias.name}"
                out.append((sub if sub in MODULES else pkg, node.lineno))
    return out


def _is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _where(name: str, line: int) -> str:
    path = MODULES[name]
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def _offences(modules, forbidden, *, allowed_importers=()):
    """'file:line imports X' for each import of a `forbidden` module by one of `modules`."""
    return [f"{_where(m, line)} imports {imp}"
            for m in modules if m not in allowed_importers
            for imp, line in _imports(m) if _is_under(imp, forbidden)]


def _transitive_offences(start: str, forbidden, within: str) -> list[str]:
    """Import chains from `start` through modules of package `within` to a `forbidden` module."""
    seen, stack, found = {start}, [(start, [])], []
    while stack:
        mod, chain = stack.pop()
        for imp, line in _imports(mod):
            link = chain + [f"{_where(mod, line)} imports {imp}"]
            if _is_under(imp, forbidden):
                found.append(" -> ".join(link))
            elif _is_under(imp, (within,)) and imp in MODULES and imp not in seen:
                seen.add(imp)
                stack.append((imp, link))
    return found


def _fail_if(offences, rule):
    if offences:
        pytest.fail(f"{rule}:\n  " + "\n  ".join(sorted(offences)), pytrace=False)


def test_modules_found():
    for name in ("pallas_kernels", "jax_sparse_mla.kernels", "jax_sparse_mla.plan", HARNESS, THE_ALLOCATOR[0],
                 "tests.conftest"):
        assert name in MODULES, name
    assert sum(m.startswith("pallas_kernels.") for m in MODULES) >= 4


def test_pallas_kernels_import_nothing_from_jax_sparse_mla():
    kernels = [m for m in MODULES if _is_under(m, ("pallas_kernels",))]
    _fail_if(_offences(kernels, ("jax_sparse_mla",)), "pallas_kernels must not import jax_sparse_mla")


def test_only_the_dispatch_module_imports_pallas_kernels():
    layer = [m for m in MODULES if _is_under(m, ("jax_sparse_mla",))]
    _fail_if(_offences(layer, ("pallas_kernels",), allowed_importers=("jax_sparse_mla.kernels",)),
             "only jax_sparse_mla/kernels.py may import pallas_kernels")


@pytest.mark.parametrize("module", [m for m in HOST_PLANNING if m in MODULES] or
                         [pytest.param("jax_sparse_mla.plan", marks=pytest.mark.skip("no planning module"))])
def test_host_planning_imports_no_kernel_module(module):
    _fail_if(_transitive_offences(module, KERNEL_MODULES, "jax_sparse_mla"),
             f"{module} must not import a kernel module ({', '.join(KERNEL_MODULES)}), even transitively")


def test_the_layer_never_imports_the_harness():
    layer = [m for m in MODULES if _is_under(m, ("jax_sparse_mla",)) and not _is_under(m, (HARNESS,))]
    _fail_if(_offences(layer, (HARNESS,), allowed_importers=HARNESS_IMPORTERS),
             f"jax_sparse_mla's modules outside the harness ({HARNESS}) must not import it")


def test_the_harness_holds_the_only_page_allocator():
    found = [(m, node.name, node.lineno) for m in MODULES if _is_under(m, ("jax_sparse_mla", "pallas_kernels"))
             for node in ast.walk(ast.parse(MODULES[m].read_text(), str(MODULES[m])))
             if isinstance(node, ast.ClassDef) and node.name.endswith("Allocator")]
    assert THE_ALLOCATOR in [(m, name) for m, name, _ in found], f"{THE_ALLOCATOR} not found"
    _fail_if([f"{_where(m, line)} defines {name}" for m, name, line in found if (m, name) != THE_ALLOCATOR],
             f"the one page allocator is {'.'.join(THE_ALLOCATOR)}")


def test_tests_import_no_test_module():
    tests = [m for m in MODULES if _is_under(m, ("tests",))]
    offences = [f"{_where(m, line)} imports {imp}" for m in tests for imp, line in _imports(m)
                if imp.split(".")[-1].startswith("test_") or imp.split(".")[-1] == "conftest"]
    _fail_if(offences, "tests must not import test modules or conftest (shared helpers: tests.support)")


def test_rules_catch_offences(tmp_path, monkeypatch):
    """The checks above name the offending import (a planted module that breaks each rule)."""
    planted = {"jax_sparse_mla.planted": "from . import kernels\n",
               "jax_sparse_mla.planted_pages": "from .serving import Engine\n\n\nclass FreeListAllocator:\n    pass\n",
               "tests.test_planted": "from tests.test_layering import MODULES\n"}
    for name, source in planted.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(source)
        monkeypatch.setitem(MODULES, name, path)
    chains = _transitive_offences("jax_sparse_mla.planted", KERNEL_MODULES, "jax_sparse_mla")
    assert chains and "imports jax_sparse_mla.kernels" in chains[0], chains
    with pytest.raises(pytest.fail.Exception, match="imports tests.test_layering"):
        test_tests_import_no_test_module()
    with pytest.raises(pytest.fail.Exception, match="planted_pages.py:1 imports jax_sparse_mla.serving"):
        test_the_layer_never_imports_the_harness()
    with pytest.raises(pytest.fail.Exception, match="planted_pages.py:4 defines FreeListAllocator"):
        test_the_harness_holds_the_only_page_allocator()
