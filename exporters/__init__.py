"""Node agent: one /metrics endpoint with GPU (NVML), InfiniBand/RoCE (sysfs) and tracer collectors."""
