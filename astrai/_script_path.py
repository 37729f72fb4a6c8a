"""Imported first by astrai/train.py when run as a script (`deepspeed astrai/train.py`).

Python then puts astrai/ itself first on sys.path, where our `config`, `data`, ... would shadow any top-level
module of the same name, and the package `astrai` is not importable; this moves the repository root there
instead. It is found as a top-level module for exactly that reason: astrai/ is on sys.path.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))
