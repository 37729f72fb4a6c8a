"""Starting a job: the multi-node launcher (`python -m astrai launch`), the job checks it and every rank run
first, the memory planner (`plan`), and each rank's start-up (environment, output_dir lock, launcher watch,
rank report, preflight). Nothing here imports astrai/training/: the launcher starts the trainer as a program.
"""
