"""The `diffusion` engine family: diffusers pipelines, with request batching and speed options.

- `engine`: `DiffusionEngine`, load, self-check, batched pipeline calls.
- `accel`: the speed options (FP8 matmuls, Flux block rewrites, step caching, CUDA graphs, attention backend).
- `parallel`: sequence parallelism over one process per GPU.
- `png`: the stage's own multi-threaded PNG encoder; `video`: MP4 encoding of video outputs.

Importing this package imports no diffusers: the factory imports `engine` by name when a diffusion stage starts.
"""
