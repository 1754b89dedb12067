"""pyproject.toml is the one source of Python dependencies; check the other files agree.

- environment.yml lists only python, pip and non-Python programs, and installs ``-e .[dev]``
  (conda-pypi guidance: "only install Python & pip inside conda", then let pip own every
  Python package; see shared/reference/research/teaching_viz.md §5).
- Every third-party module imported by ``minirad/`` and ``viz/`` is a declared runtime
  dependency (an undeclared import works on the author's machine and fails on a fresh one).
"""

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"minirad", "viz"}
# conda packages that are programs, not Python packages (pip must own every Python package).
NON_PYTHON_CONDA_PACKAGES = {"graphviz", "nodejs"}
# Import name -> distribution name, for modules that are not installed here (when installed,
# importlib.metadata.packages_distributions() answers).
IMPORT_TO_DIST = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "IPython": "ipython",
    "sklearn": "scikit-learn",
    "cv2": "opencv-python",
    "skimage": "scikit-image",
    "bs4": "beautifulsoup4",
    "attr": "attrs",
    "jupyter_core": "jupyter-core",
}


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@cache
def environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def conda_and_pip_entries() -> tuple[list[str], list[str]]:
    conda, pip = [], []
    for dep in environment()["dependencies"]:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected mapping in dependencies: {dep}"
            pip.extend(dep["pip"])
        else:
            conda.append(str(dep))
    return conda, pip


def conda_name(spec: str) -> str:
    return re.split(r"[=<>!~ ]", spec, maxsplit=1)[0].split("::")[-1]


def test_environment_uses_conda_forge_only():
    assert environment()["channels"] == ["conda-forge"]


def test_environment_lists_only_python_pip_and_programs():
    conda, _ = conda_and_pip_entries()
    names = [conda_name(spec) for spec in conda]
    assert "python" in names and "pip" in names
    extra = set(names) - {"python", "pip"} - NON_PYTHON_CONDA_PACKAGES
    assert not extra, f"Python packages belong in pyproject.toml, not environment.yml: {extra}"


def test_environment_python_satisfies_requires_python():
    conda, _ = conda_and_pip_entries()
    (python,) = [spec for spec in conda if conda_name(spec) == "python"]
    match = re.fullmatch(r"python\s*=+\s*(\d+\.\d+(\.\d+)?)(\.\*)?", python)
    assert match, f"pin python to a version, e.g. python=3.11 (got {python!r})"
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert Version(match.group(1)) in requires


def test_environment_installs_the_project_with_dev_extra():
    _, pip = conda_and_pip_entries()
    assert pip == ["-e .[dev]"]
    assert "dev" in pyproject()["project"]["optional-dependencies"]


def test_torch_pinned_exactly():
    # An unpinned torch pulls the CUDA build; committed notebook outputs assume one version.
    reqs = {
        canonicalize_name(Requirement(r).name): r for r in pyproject()["project"]["dependencies"]
    }
    assert Requirement(reqs["torch"]).specifier == SpecifierSet("==2.13.0")


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> files importing it, over minirad/ and viz/ (absolute imports)."""
    found: dict[str, set[str]] = {}
    files = [p for d in FIRST_PARTY for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in FIRST_PARTY or top == "__future__":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distributions_for(module: str) -> set[str]:
    installed = packages_distributions().get(module, [])
    names = set(installed) | {IMPORT_TO_DIST.get(module, module)}
    return {canonicalize_name(n) for n in names}


# Developer tools inside the packages that may import dev-only dependencies (they import them
# inside the function that needs them and say what to install when they are missing).
DEV_TOOLS = {"viz/bench.py"}
# Run by the real vLLM's and SGLang's own venvs (`make vllm`, `make sglang`), never imported
# here: vllm and sglang are their dependencies.
VLLM_VENV_SCRIPTS = {
    "minirad/bench/vllm_worker.py",
    "minirad/bench/sglang_worker.py",
    "minirad/bench/sglang_swa_worker.py",
}


def test_every_third_party_import_is_declared():
    project = pyproject()["project"]
    declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    dev = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["dev"]}
    missing = {
        module: sorted(files)
        for module, files in third_party_imports().items()
        if not distributions_for(module) & (declared | (dev if files <= DEV_TOOLS else set()))
        and not files <= VLLM_VENV_SCRIPTS
    }
    assert not missing, f"imported but not in [project.dependencies]: {missing}"


@pytest.mark.parametrize(
    ("module", "dist"), [("PIL", "pillow"), ("yaml", "pyyaml"), ("torch", "torch")]
)
def test_import_name_mapping(module, dist):
    assert dist in distributions_for(module)
