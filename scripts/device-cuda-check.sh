#!/usr/bin/env bash
# The GPU checks in one call, on a bare machine whose python3 already holds a CUDA torch (grpcio, pytest; no
# network, no install of this project): the `shardserve` import names made to work from this checkout, the
# CUDA tests, the CUDA benchmark, then one summary table. Run from anywhere; results go under $OUT.
#
#   bash scripts/device-cuda-check.sh                  imports, `pytest -m cuda`, `python -m benchmarks --only cuda`
#   bash scripts/device-cuda-check.sh --check-imports  only the import stage (no GPU needed)
#   bash scripts/device-cuda-check.sh -q -n 8          pytest arguments replace `-m cuda -v`
#   bash scripts/device-cuda-check.sh --exec CMD ...   runs CMD with the import names (a profile, one benchmark)
#
# Exits 2 when a package does not import, else pytest's status when a test failed or a stage timed out (124),
# else the benchmark's. Each stage has a time limit, so the whole run ends within 6 minutes.
# Environment: PYTHON (python3), OUT (/tmp/out), TESTS_TIMEOUT_S (180), BENCH_TIMEOUT_S (120), BENCH_ARGS
# (more `python -m benchmarks` arguments, e.g. --quick), SHARDSERVE_BENCH_CUDA_MIB (caps the CUDA sizes).
# Wheels for the gRPC/protobuf versions we pin may travel in .whl/ (docs/development.md, "GPU tests").
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/out}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-180}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-120}
export PYTHONUNBUFFERED=1

# The import names exist only through setuptools' package-dir mapping (pyproject.toml), so without an install
# a temporary folder stands in for the installed package: `shardserve/` whose entries are symlinks to the
# mapped folders (client -> client/, core -> shardcore/, ...), first on PYTHONPATH, and a sitecustomize that
# looks `shardserve` up there first even where the repository root comes before it on sys.path (python -m
# from the root, pytest's pythonpath, the ranks' PYTHONPATH), so that every process the tests start sees it.
build_import_tree() {
  "$PY" - "$REPO" "$1" <<'PYTHON'
import os
import re
import sys
from pathlib import Path

repo, tree = Path(sys.argv[1]), Path(sys.argv[2])
text = (repo / "pyproject.toml").read_text()
mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w./-]+)"', re.search(r"package-dir\s*=\s*\{(.*?)\}", text).group(1)))
for name, folder in sorted(mapping.items()):
    where = tree.joinpath(*name.split("."))
    if name == "shardserve":
        where.mkdir(parents=True)
        for entry in (repo / folder).iterdir():
            if entry.name != "__pycache__":
                (where / entry.name).symlink_to(entry)
    else:
        where.symlink_to(repo / folder, target_is_directory=True)
(tree / "sitecustomize.py").write_text(f'''"""Finds `shardserve` in {tree} before any other sys.path entry, then runs the sitecustomize it shadows."""
import importlib.util
import os
import sys
from importlib.machinery import PathFinder

HERE = {str(tree)!r}


class TreeFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return PathFinder.find_spec(name, [HERE]) if name == "shardserve" else None


sys.meta_path.insert(0, TreeFinder)
_others = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
_spec = PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
''')
PYTHON
}

# Imports every package pyproject lists, from the repository root with the root first on PYTHONPATH (as the
# ranks are started), and checks that a child process started so finds the same package. A package that needs
# an optional extra which is not installed (torchrec) is reported, not failed.
check_imports() {
  PYTHONPATH="$REPO:$PYTHONPATH" "$PY" - "$REPO" <<'PYTHON'
import importlib
import re
import subprocess
import sys
from pathlib import Path

repo = Path(sys.argv[1])
text = (repo / "pyproject.toml").read_text()
packages = re.findall(r'"([\w.]+)"', re.search(r"^packages\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1))
extras = re.search(r"^\[project\.optional-dependencies\](.*?)^\[", text, re.S | re.M).group(1)
optional = {
    re.split(r"[-_\[<>=!~ ]", requirement)[0]
    for group, body in re.findall(r"^(\w+)\s*=\s*\[(.*?)\]", extras, re.S | re.M)
    if group != "dev"
    for requirement in re.findall(r'"([^"]+)"', body)
}
# A child started as the ranks are (its cwd and PYTHONPATH led by the root) must find the tree's `shardserve`.
where_child_finds = (
    "import importlib.util, pathlib; spec = importlib.util.find_spec('shardserve'); "
    "print(pathlib.Path(spec.submodule_search_locations[0], 'client').resolve())"
)
child = subprocess.Popen(
    [sys.executable, "-c", where_child_finds], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
)
failed = []
for name in packages:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing.split(".")[0] in optional:
            print(f"  {name}: not imported, needs the optional {missing!r} (not installed)")
            continue
        failed.append(f"{name}: {type(err).__name__}: {err}")
    except ImportError as err:
        cause = err.__cause__
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] in optional:
            print(f"  {name}: not imported, needs the optional {cause.name!r} (not installed)")
            continue
        failed.append(f"{name}: {type(err).__name__}: {err}")
    else:
        where = Path(module.__file__).resolve()
        if where.is_relative_to(repo):
            print(f"  {name}: {where.relative_to(repo)}")
        else:
            failed.append(f"{name}: imported from {where}, not from this checkout")
stdout, stderr = child.communicate(timeout=120)
if child.returncode != 0 or stdout.strip() != str(repo / "client"):
    failed.append(f"a child process finds shardserve.client at {stdout.strip()!r}, not in {repo}: {stderr[-1500:]}")
for line in failed:
    print(f"IMPORT FAILED {line}")
print(f"imports: {len(packages) - len(failed)} of {len(packages)} packages checked, {len(failed)} failed")
sys.exit(1 if failed else 0)
PYTHON
}

CHECK_IMPORTS_ONLY=0
EXEC=0
if [ "${1:-}" = "--check-imports" ]; then
  CHECK_IMPORTS_ONLY=1
  shift
elif [ "${1:-}" = "--exec" ]; then
  EXEC=1
  shift
fi
if [ "$CHECK_IMPORTS_ONLY" = 0 ]; then
  mkdir -p "$OUT"
  rm -f "$OUT/cuda-tests.xml" "$OUT/cuda-bench.json"  # a stage that leaves none is reported, not an old one
  # Installed into python's own environment (not a --target dir) so that the processes tests start see them too.
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 2
  fi
fi
TREE=$(mktemp -d "${TMPDIR:-/tmp}/shardserve-imports.XXXXXX") || exit 2
trap 'rm -rf "$TREE"' EXIT
build_import_tree "$TREE" || { echo "could not build the import tree in $TREE" >&2; exit 2; }
export PYTHONPATH="$TREE:$REPO:$REPO/tests${PYTHONPATH:+:$PYTHONPATH}"
echo "== imports (PYTHONPATH=$PYTHONPATH)"
if ! check_imports; then
  echo "FAILED: not every shardserve package imports from $REPO with $PY (see above)" >&2
  exit 2
fi
if [ "$CHECK_IMPORTS_ONLY" = 1 ]; then
  exit 0
fi
if [ "$EXEC" = 1 ]; then
  "$@"  # not exec: the trap removes the import tree once the command is done
  exit $?
fi

echo "== machine"
nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
"$PY" -c "import torch, grpc, google.protobuf as p, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'nccl', d.is_nccl_available(), torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'grpc', grpc.__version__, 'protobuf', p.__version__)"

if [ $# -eq 0 ]; then set -- -m cuda -v; fi
echo "== tests (at most ${TESTS_TIMEOUT_S} s): pytest $*"
timeout -k 5 "$TESTS_TIMEOUT_S" "$PY" -m pytest -p no:cacheprovider -rs --junitxml="$OUT/cuda-tests.xml" "$@" \
  2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark (at most ${BENCH_TIMEOUT_S} s): python -m benchmarks --only cuda ${BENCH_ARGS:-}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
timeout -k 5 "$BENCH_TIMEOUT_S" "$PY" -m benchmarks --only cuda --json "$OUT/cuda-bench.json" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/cuda-bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== summary"
"$PY" -m benchmarks.summary --junit "$OUT/cuda-tests.xml" --tests-status "$tests_rc" \
  --bench "$OUT/cuda-bench.json" --bench-status "$bench_rc" | tee "$OUT/summary.txt"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
