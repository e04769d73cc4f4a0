"""Tensor parallelism: a model cut among processes (shards.py), the sums that cross them (combine.py), the
group's processes (group.py, worker.py) and the steps rank 0 broadcasts (steps.py)."""
