"""CPU execution: mpirt's thread pool and GEMM path (threads), the GEMM library chosen (blas), the
C kernels, the host allocator setting (hostalloc) and what the machine is (sysinfo)."""
