"""GPU execution: the CuPy backend's fused CUDA kernels (:mod:`mpirt.gpu.cuda`, source
``cuda_kernels.cu``, compiled by NVRTC on first use) and their launchers. The ops call them where
they take the arrays and run their xp forms otherwise; :mod:`mpirt.cpu` is the CPU's counterpart."""
