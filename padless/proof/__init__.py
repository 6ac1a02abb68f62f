"""What is proven: the load-time probe and its reuse, loading a model on a proven backend, the invariance
check, tolerances, the zoo of architectures and the machine's doctor."""
