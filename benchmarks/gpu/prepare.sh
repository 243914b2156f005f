#!/usr/bin/env bash
# Run once on a machine with PyPI access, from the repository root: puts into .whl/ (git-ignored) the
# packages of requirements.txt (and google-jetstream) that the GPU machine's image lacks, as Python 3.12
# wheels (about 14 MB). The image already has jax (CUDA), flax, optax, orbax-checkpoint, numpy, grpcio,
# tensorstore, tqdm, matplotlib, ...; the list below is requirements.txt minus the image's packages.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  google-jetstream==0.2.2 ml_collections==1.1.0 \
  tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 array_record==0.8.6 grain==0.2.18 dm-tree==0.1.10 \
  immutabledict==4.3.1 simple-parsing==0.1.9 docstring_parser==0.18.0 termcolor==3.3.0 toml==0.10.2 \
  portpicker==1.6.0 googleapis-common-protos==1.76.0 protobuf==7.36.2 importlib_resources==7.1.0 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 tensorboardX==2.6.5 \
  blobfile==3.3.0 pycryptodomex==3.24.2 shortuuid==1.0.13 httpcore2==2.16.2 httpx2==2.16.2 \
  truststore==0.10.5 tzdata==2026.6
# promise (a tensorflow-datasets requirement) is published as source only: build its pure-Python wheel.
python3 -m pip wheel --no-deps -w .whl promise==2.3
ls -l .whl
du -sh .whl
