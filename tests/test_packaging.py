"""Packaging: version, license, typing marker, declared dependencies, the jax version gate and the CLI.

CPU only, no network. The declarations are read from pyproject.toml, so the checks hold for a
checkout run as it is (`scripts/dev.sh test --no-install`, the GPU runner's pre-built environment).
Where the distribution is installed (`pip install -e .`, what `scripts/dev.sh test` does), its
metadata must say the same: a stale install (pyproject or the version changed since) fails here
until reinstalled.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import jax_sparse_mla
from pallas_kernels import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIST = "jax_sparse_mla"
FIRST_PARTY = {"jax_sparse_mla", "pallas_kernels"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _parse(requirements: list[str]) -> dict[str, str]:
    """{normalised distribution name: specifier} of PEP 508 requirement strings (markers dropped)."""
    out = {}
    for req in requirements:
        spec = req.partition(";")[0]
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)", spec)
        out[_norm(m[1])] = m[3].strip()
    return out


def _requirements(extra: str | None = None) -> dict[str, str]:
    """The requirements pyproject declares: the runtime ones (extra None) or one extra's."""
    project = PYPROJECT["project"]
    return _parse(project["dependencies"] if extra is None else project["optional-dependencies"][extra])


def _installed_requirements(extra: str | None = None) -> dict[str, str]:
    """The same from the installed distribution's metadata."""
    reqs = []
    for req in importlib.metadata.requires(DIST) or []:
        marker = req.partition(";")[2]
        if (extra is None) == (not marker.strip()) and (extra is None or f'extra == "{extra}"' in marker):
            reqs.append(req)
    return _parse(reqs)


def _specifiers(spec: str) -> set[str]:
    return {s.strip() for s in spec.split(",") if s.strip()}


def _run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_installed_metadata_matches_pyproject():
    """An installed distribution says what pyproject says; without one, the package under test is
    this checkout's (so the pyproject checks below are about the code that runs)."""
    try:
        meta = importlib.metadata.metadata(DIST)
    except importlib.metadata.PackageNotFoundError:
        assert pathlib.Path(jax_sparse_mla.__file__).resolve().is_relative_to(ROOT)
        return
    assert meta["Version"] == jax_sparse_mla.__version__
    assert meta["License-Expression"] == PYPROJECT["project"]["license"]
    assert sorted(meta.get_all("License-File") or []) == sorted(PYPROJECT["project"]["license-files"])
    for extra in (None, *PYPROJECT["project"]["optional-dependencies"]):
        installed, declared = _installed_requirements(extra), _requirements(extra)
        assert {name: _specifiers(spec) for name, spec in installed.items()} == \
            {name: _specifiers(spec) for name, spec in declared.items()}, extra


def test_version_is_a_literal_setuptools_reads_without_importing():
    # pyproject: version = {attr = "jax_sparse_mla.__version__"}; setuptools reads a plain literal by ast
    tree = ast.parse((ROOT / "jax_sparse_mla" / "__init__.py").read_text())
    literals = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    assert literals == [jax_sparse_mla.__version__]
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jax_sparse_mla.__version__"}


def test_changelog_has_this_version():
    assert f"## [{jax_sparse_mla.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_license_file_and_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "the jax_sparse_mla authors" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_py_typed_is_package_data():
    assert (pathlib.Path(jax_sparse_mla.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["jax_sparse_mla"]


def _third_party_imports() -> dict[str, list[str]]:
    """{top-level module: [file:line, ...]} of every absolute import in the two packages (in functions too)."""
    found: dict[str, list[str]] = {}
    stdlib = set(sys.stdlib_module_names)
    for pkg in sorted(FIRST_PARTY):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in stdlib and top not in FIRST_PARTY:
                        found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_third_party_import_is_a_declared_dependency():
    imports = _third_party_imports()
    assert {"jax", "numpy", "ml_dtypes"} <= set(imports), sorted(imports)  # the scan sees the known ones
    declared = set(_requirements())
    to_dists = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in sorted(imports.items()):
        dists = {_norm(d) for d in to_dists.get(module, [])}
        if not dists & declared:
            missing[module] = (sorted(dists) or ["(not installed)"], where[:3])
    assert not missing, f"imported but not declared in pyproject's dependencies: {missing}"


def test_ml_dtypes_is_declared():
    assert "ml-dtypes" in _requirements()


def test_declared_jax_range_is_the_gate():
    supported = _specifiers(compat.SUPPORTED)
    runtime = _requirements()
    assert _specifiers(runtime["jax"]) == supported
    assert _specifiers(runtime["jaxlib"]) == supported
    for extra in ("cuda12", "cuda13"):
        assert _specifiers(_requirements(extra)["jax"]) == supported, extra
    compat.check_jax_version(importlib.metadata.version("jax"))  # this environment is inside it


@pytest.mark.parametrize("version", ["0.11.2", "0.11.3", "0.11.10", "0.11.2.dev20261201"])
def test_version_gate_accepts(version):
    compat.check_jax_version(version)


@pytest.mark.parametrize("version", ["0.11.1", "0.10.9", "0.12.0", "0.12.0rc1", "0.12.0.dev20261201", "1.0.0",
                                     "not-a-version"])
def test_version_gate_rejects(version):
    with pytest.raises(ImportError, match=re.escape(f"jax{compat.SUPPORTED}")):
        compat.check_jax_version(version)


def test_pallas_kernels_import_refuses_an_unsupported_jax():
    script = (
        "import os, sys, jax\n"
        "jax.__version__ = '0.12.1'\n"
        "try:\n"
        "    import pallas_kernels\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    sys.exit('imported')\n"
        f"os.environ[{compat.SKIP_ENV!r}] = '1'\n"
        "import pallas_kernels\n"
        "print('skipped')\n")
    r = _run("-c", script, env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"refused: pallas_kernels supports jax{compat.SUPPORTED}" in r.stdout and "found jax 0.12.1" in r.stdout
    assert "skipped" in r.stdout


def _imported_modules(importtime_stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["demo", "--help"]])
def test_cli_help_and_version_do_not_import_jax(args):
    r = _run("-X", "importtime", "-m", "jax_sparse_mla", *args)
    assert r.returncode == 0, r.stderr
    modules = _imported_modules(r.stderr)
    assert "jax_sparse_mla" in modules  # importtime's report was parsed
    heavy = sorted(m for m in modules if m.split(".")[0] in {"jax", "jaxlib", "numpy", "flax", "orbax"})
    assert not heavy, heavy
    if args == ["--version"]:
        assert r.stdout.strip() == f"jax_sparse_mla {jax_sparse_mla.__version__}"
    elif args == ["--help"]:
        assert "demo" in r.stdout and "--version" in r.stdout
    else:
        assert "--force" in r.stdout and "deepseek_v32" in r.stdout


def test_exports_are_one_list_imported_on_first_use():
    """`__all__` is the lazy-import table's names: importing the package loads no submodule, and each
    exported name is the object its submodule defines, loaded when first asked for."""
    script = (
        "import importlib, sys\n"
        "import jax_sparse_mla as m\n"
        "loaded = sorted(k for k in sys.modules if k.startswith('jax_sparse_mla.'))\n"
        "assert not loaded, loaded\n"
        "assert m.__all__ == sorted(set(m.__all__)) == sorted(m._EXPORTS), m.__all__\n"
        "for name in m.__all__:\n"
        "    assert getattr(m, name) is getattr(importlib.import_module(f'jax_sparse_mla.{m._EXPORTS[name]}'), name)\n"
        "assert set(m.__all__) <= set(dir(m))\n"
        "print(len(m.__all__))\n")
    r = _run("-c", script, env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.split()[-1]) == len(jax_sparse_mla.__all__)


def test_demo_refuses_deepseek_v32_on_cpu_without_force():
    r = _run("-m", "jax_sparse_mla", "demo", "--config", "deepseek_v32", env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "minutes" in r.stderr and "--force" in r.stderr
    assert "config deepseek_v32" not in r.stdout  # refused before building anything
