import os

import lit.formats

config.name = "flint-pass-example"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.test_source_root = os.path.dirname(__file__)
config.environment["PATH"] = os.environ["PATH"]
for var in ("HOME", "TMPDIR", "PYTHONPATH"):
    if var in os.environ:
        config.environment[var] = os.environ[var]
