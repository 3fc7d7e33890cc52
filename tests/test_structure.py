"""The house limits on the code's shape, checked with the ast module over the shipped packages: modules of at
most 500 lines, classes of at most 25 methods, functions of at most 6 positional parameters (self/cls left
out, as ruff's PLR0917 counts them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("client", "server", "protos", "shardcore", "shardserve")
MAX_MODULE_LINES = 500
MAX_CLASS_METHODS = 25
MAX_POSITIONAL = 6
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def shipped_modules() -> list[Path]:
    """Every Python module of the packages, generated protobuf modules left out."""
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "_pb2" not in path.name and "__pycache__" not in path.parts
    )


def positional_count(function: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """Positional parameters as PLR0917 counts them: a method's first (self or cls) is not counted, nor is
    a staticmethod's absence of one."""
    params = [*function.args.posonlyargs, *function.args.args]
    decorators = {d.id for d in function.decorator_list if isinstance(d, ast.Name)}
    if in_class and params and "staticmethod" not in decorators:
        params = params[1:]
    return len(params)


def functions_with_owner(
    tree: ast.Module,
) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Every function in `tree`, with whether it is defined directly in a class body."""
    found = []
    for node in ast.walk(tree):
        body = node.body if isinstance(node, (ast.Module, ast.ClassDef, *FUNCTIONS)) else []
        for child in body:
            if isinstance(child, FUNCTIONS):
                found.append((child, isinstance(node, ast.ClassDef)))
    return found


def offenders_of(path: Path, root: Path = ROOT) -> list[str]:
    """What in module `path` breaks a limit, one line each, named relative to `root`."""
    text = path.read_text()
    name = path.relative_to(root).as_posix()
    tree = ast.parse(text, filename=name)
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(child, FUNCTIONS) for child in node.body)
            if methods > MAX_CLASS_METHODS:
                found.append(
                    f"{name}:{node.lineno} class {node.name}: {methods} methods (> {MAX_CLASS_METHODS})"
                )
    for function, in_class in functions_with_owner(tree):
        count = positional_count(function, in_class)
        if count > MAX_POSITIONAL:
            found.append(
                f"{name}:{function.lineno} {function.name}(): {count} positional parameters (> {MAX_POSITIONAL})"
            )
    return found


def test_the_checks_see_the_packages() -> None:
    """The walk finds the packages' modules (an empty walk would pass every limit)."""
    names = {path.relative_to(ROOT).as_posix() for path in shipped_modules()}
    assert {"protos/errors.py", "shardcore/metadata.py", "server/common/errors.py"} <= names
    assert not any("_pb2" in name for name in names)


def test_positional_count_follows_plr0917() -> None:
    """self and cls are not counted, keyword-only parameters are not, a staticmethod's first one is."""
    tree = ast.parse(
        "class C:\n"
        "    def m(self, a, b, /, c, *, d): ...\n"
        "    @staticmethod\n"
        "    def s(a, b): ...\n"
        "    @classmethod\n"
        "    def k(cls, a): ...\n"
        "def f(a, b, c, d, e, f, g): ...\n"
    )
    counts = {
        fn.name: positional_count(fn, in_class) for fn, in_class in functions_with_owner(tree)
    }
    assert counts == {"m": 3, "s": 2, "k": 1, "f": 7}


def test_offenders_are_reported(tmp_path: Path) -> None:
    """A module over every limit is reported once per limit it breaks."""
    methods = "".join(f"    def m{i}(self): ...\n" for i in range(MAX_CLASS_METHODS + 1))
    padding = "\n" * MAX_MODULE_LINES
    module = tmp_path / "probe.py"
    module.write_text(f"class Big:\n{methods}def wide(a, b, c, d, e, f, g): ...\n{padding}")
    found = offenders_of(module, tmp_path)
    assert len(found) == 3, found
    assert "lines" in found[0] and "class Big" in found[1] and "wide()" in found[2]


def test_code_stays_within_the_house_limits() -> None:
    """No module over 500 lines, no class over 25 methods, no function over 6 positional parameters."""
    offenders = [line for path in shipped_modules() for line in offenders_of(path)]
    assert not offenders, "over the house limits:\n" + "\n".join(offenders)
