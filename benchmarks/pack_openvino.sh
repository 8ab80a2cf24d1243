#!/usr/bin/env bash
# OpenVINO and NNCF for a lent GPU machine (Python 3.12, no network), for lent_machine.sh's openvino-int8:
#   .ov1/  the openvino wheel (~57 MiB: a call of its own, 64 MiB at most)
#   .ov2/  nncf and what it imports that the machine's image lacks (~4 MiB: fits beside .gpu2), and
#          stub/scipy: NNCF imports scipy.linalg.lstsq when it loads (quantizing never calls it here),
#          and SciPy's wheel (35 MB) fits no call; installed only where the image has no SciPy.
# Installing, on the machine (after ../shared/gpu/README.md's TVM):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ov2/*.whl
#   python3 -c "import scipy" 2>/dev/null || cp -r .ov2/stub/scipy /tmp/site/
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ov1/*.whl
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OPENVINO=${OPENVINO:-$(.venv/bin/python -c "import openvino; print(openvino.__version__.split('-')[0])")}
NNCF=${NNCF:-$(.venv/bin/python -c "import nncf; print(nncf.__version__)")}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .ov1 .ov2; do
  grep -qxF "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"
  rm -rf "$d"; mkdir -p "$d"
done
py=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps "${py[@]}" -d .ov1 "openvino==$OPENVINO"
python3 -m pip download -q --no-deps "${py[@]}" -d .ov2 "nncf==$NNCF" networkx narwhals ninja pydot pyparsing tabulate joblib threadpoolctl openvino-telemetry
mkdir -p .ov2/stub/scipy
echo '"""Stand-in for SciPy where a lent machine has none: NNCF imports scipy.linalg.lstsq when it loads."""' > .ov2/stub/scipy/__init__.py
printf 'import numpy as np\n\n\ndef lstsq(a, b, *args, **kwargs):\n    return np.linalg.lstsq(a, b, rcond=None)\n' > .ov2/stub/scipy/linalg.py
du -sh .ov1 .ov2
