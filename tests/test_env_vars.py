"""k3 reads only the documented environment variables; every other choice is typed configuration.

Every module of k3 is parsed (nothing is imported): each use of `os.environ` / `os.getenv` must read a
key that is a string literal (or a module-level string constant) from ALLOWED, and each allowed name must
be documented in docs/environment.md. Kernel choices live in `k3.kernel_config.KernelConfig`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import k3

ROOT = Path(k3.__file__).parent
DOC = ROOT.parent / "docs" / "environment.md"

# name -> what reads it (the full story is in docs/environment.md)
ALLOWED = {
    "K3_DEBUG": "k3.cli: full tracebacks for user errors",
    "K3_CACHE_DIR": "k3.data.packing: tokenised-corpus cache directory",
    "TRITON_INTERPRET": "k3.ops: Triton's CPU interpreter (how the CPU tests run the kernels)",
    "WORLD_SIZE": "k3.distributed.mesh, k3.train: torchrun's process count",
    "RANK": "k3.cli: torchrun's process rank (only rank 0 prints)",
    "LOCAL_RANK": "k3.distributed.mesh: torchrun's GPU index on the host",
}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _key(node: ast.AST | None, consts: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def env_reads(path: Path) -> list[tuple[int, str | None]]:
    """(line, key or None when the key is not a literal) of every environment access in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    consts = _constants(tree)
    reads: list[tuple[int, str | None]] = []
    handled: set[int] = set()  # environ nodes already accounted for by an enclosing access
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if _is_environ(f.value):  # os.environ.get / pop / setdefault / ...
                reads.append((node.lineno, _key(node.args[0] if node.args else None, consts)))
                handled.add(id(f.value))
            elif f.attr == "getenv":
                reads.append((node.lineno, _key(node.args[0] if node.args else None, consts)))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            reads.append((node.lineno, _key(node.slice, consts)))
            handled.add(id(node.value))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.lineno, _key(node.left, consts)))
            handled.update(id(c) for c in node.comparators)
    for node in ast.walk(tree):  # any other use of the environment (passed on whole, iterated, ...)
        if _is_environ(node) and id(node) not in handled:
            reads.append((node.lineno, None))
    return reads


def test_only_documented_env_vars_are_read():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for line, key in env_reads(path):
            if key not in ALLOWED:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {key or '<not a literal key>'}")
    assert not bad, ("environment reads outside the documented list (make it a typed config field, e.g. "
                     "k3.kernel_config.KernelConfig, or document it in docs/environment.md and ALLOWED):\n"
                     + "\n".join(bad))


def test_allowed_env_vars_are_documented():
    doc = DOC.read_text(encoding="utf-8")
    assert len(ALLOWED) <= 8
    missing = [name for name in ALLOWED if f"`{name}`" not in doc]
    assert not missing, f"{DOC.name} does not document {missing}"


def test_the_checker_sees_every_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom os import environ\nKEY = 'K3_X'\n"
                   "a = os.environ.get('K3_A')\nb = os.environ['K3_B']\nc = os.getenv('K3_C', '1')\n"
                   "d = 'K3_D' in os.environ\ne = os.environ.get(KEY)\nf = environ.get(name)\n"
                   "g = dict(os.environ)\n", encoding="utf-8")
    assert sorted(env_reads(src)) == [(4, "K3_A"), (5, "K3_B"), (6, "K3_C"), (7, "K3_D"), (8, "K3_X"), (9, None),
                                      (10, None)]
