"""A launcher that runs the training script as runpy would (the script then puts src/ on sys.path)."""

import runpy

runpy.run_path("train.py", run_name="__main__")
