#!/usr/bin/env bash
# The supported torch range's two ends: the unit tier plus the session, wrap, checkpoint,
# run-state, hang and device-parametrized (test_gpu's CPU half) engine tests and a step a failure
# cut short (FSDP2's iteration state, reset by private names on 2.11), each torch in a venv of
# its own with what those tests need (the test-core extra, not the notebook, docs and
# trainer packages of the whole suite). PyPI serves these only as CUDA builds: about 90 s
# and 4.7-5.5 GB a venv (torch alone, measured 2026-11-26), which is why the whole suite
# runs once, on the CPU build of .ci/run, and these two runs take the tests that touch
# torch's API.
#   bash .ci/torch_versions.sh 2.11.0 2.15.0
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PIP_PROGRESS_BAR=off
for v in "$@"; do
  venv="${TMPDIR:-/tmp}/fsdp_nb-torch-$v"
  rm -rf "$venv" && python3 -m venv "$venv"
  start=$(date +%s)
  # a machine's pip config may cap torch below the newest release: PyPI as it is
  PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q "torch==$v" -e ".[test-core]"
  echo "torch $v: installed in $(( $(date +%s) - start )) s, $(du -sm "$venv" | cut -f1) MB"
  "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$v'), torch.__version__"
  "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/unit tests/test_session.py tests/test_wrap.py \
    tests/test_checkpoint.py tests/test_run_state.py tests/test_hangs.py tests/test_gpu.py \
    "tests/test_failures.py::test_a_rank_failing_in_the_middle_of_a_step_leaves_a_model_that_trains_on"
  rm -rf "$venv"
done
