"""The ``processes`` backend: worker processes over shared memory. ``backend`` (the driver's
side and the registration), ``worker`` (the worker process and the shared-memory layout both
sides read, the control protocol's one definition), ``lifecycle`` (starting, restarting and
closing workers), ``plan`` (how many workers, the driver's share, spin budgets), ``doorbell``
(spin-then-block doorbells on shared semaphores)."""
