"""The node agent: one per GPU host.

It registers the host's inventory with its pool's allocator, heartbeats GPU
health (NVML where GPUs exist, a simulated device model with injectable faults
otherwise), launches the job process of each grant for this host with
``CUDA_VISIBLE_DEVICES`` set, forwards its progress and checkpoints, reports
its exit, and obeys checkpoint/stop requests. Processes of allocations the
allocator no longer knows (a partition healed, a lease expired) are fenced by
the allocation epoch and stopped.

* ``devices``  GPU health: ``NvmlDevices`` and ``SimulatedDevices`` (faults)
* ``launcher`` job processes: environment, checkpoint folder, progress lines, signals
* ``agent``    ``NodeAgent``: the loop against the log contract
"""
