"""What a run reports beside its phases: throughput, FLOPs and MFU, memory per phase, out-of-memory and its
snapshot, exposed communication (``comm/``), the sync census, which module (``modules/``)."""
