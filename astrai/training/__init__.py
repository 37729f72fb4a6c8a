"""Training a job: build.py (job -> Run), run_parts.py (Run), loops.py (the offline and online loops),
step_metrics.py (a step's global sums -> metrics). The top of the import graph below astrai/train.py.
"""
