"""What a run reports beside its phases: throughput, FLOPs and MFU, memory per phase, out-of-memory, exposed
communication (``comm/``), the sync census, CPU use and the input advice."""
