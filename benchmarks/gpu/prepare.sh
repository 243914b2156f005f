#!/usr/bin/env bash
# Run once on a machine with PyPI access, from the repository root: downloads the pure-Python packages
# that the GPU machine's image lacks into .whl/ (git-ignored), for Python 3.12.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .whl \
  ml-collections==1.1.0 google-jetstream==0.2.2
ls -l .whl
