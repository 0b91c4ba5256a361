"""Speech-output stages of the Qwen omni models: the talker's decode loop and codec-to-waveform decoding.

- `weights`: load one part (talker, code2wav, the thinker's embedding table) of a whole-model checkpoint.
- `talker`: `TalkerEngine`, the step-batched decode loop both talkers share (`Qwen3TalkerEngine`,
  `Qwen25TalkerEngine`); `kv_batch`: their per-request KV caches stepped as one batch.
- `qwen3_talker` / `qwen25_talker`: each model's inputs per step (thinker tokens / thinker rows).
- `slab_talker`: `SlabTalker`, the Qwen3-Omni talker's decode loop at GPU speed (KV slabs, CUDA graphs);
  `kernels`: the pure device kernels it runs (grouped MoE, norms, the hashed sampling); `sampling`: the
  talkers' sampling parameters.
- `code2wav`: `Code2WavEngine`, windowed decoding of codec frames into a waveform.
- `token2wav`: `Token2WavEngine`, Qwen2.5-Omni's DiT + BigVGAN decoder, windowed or whole output.

Model folder, device, dtype and the check of engine args are `engines.common`'s, as for every family.
"""
