# lit configuration for Flint's FileCheck golden tests.
import os

import lit.formats

config.name = "Flint"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
config.excludes = ["lit.cfg.py", "Inputs"]
# flint-opt, flint and filecheck come from the environment Flint is installed in.
config.environment["PATH"] = os.environ["PATH"]
for var in ("HOME", "TMPDIR"):
    if var in os.environ:
        config.environment[var] = os.environ[var]
