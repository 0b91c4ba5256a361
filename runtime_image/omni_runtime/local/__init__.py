"""`omnikube serve`: the whole runtime as local processes, like `vllm serve` (see `local.run`)."""
