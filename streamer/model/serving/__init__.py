"""The model's threads and processes: the worker, its queue, the pool, the child process."""
